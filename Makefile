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

.PHONY: demo demo-local test install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[worker,test,bench]"
	touch $@

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

clean:
	rm -rf $(VENV) runs
