# gdn-parity: `make parity` runs the main job, `make test` runs the tests. Both install what they need
# into .venv first (torch, the harness, FLA + Triton, TileLang; FlashQLA too where an NVIDIA GPU is present).
#
# On a GPU box without a package registry, skip the install and use what is on PYTHONPATH:
#   make parity INSTALL=0 PY=python3
PYTHON ?= python3
VENV ?= .venv
INSTALL ?= 1
ifeq ($(INSTALL),1)
PY := $(VENV)/bin/python
else
PY ?= python3
endif
comma := ,
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
EXTRAS := dev$(comma)fla$(comma)tilelang$(if $(filter 1,$(HAS_GPU)),$(comma)gpu)
TORCH ?= torch==2.13.0
# auto: the standard matrix on a GPU, the smoke matrix on a CPU
MATRIX ?= auto
PARITY_ARGS ?=
# two test processes: the CPU tests are single-threaded (torch gets one thread per worker)
PYTEST_ARGS ?= -n 2

.PHONY: install parity test list clean

install: $(if $(filter 1,$(INSTALL)),$(VENV)/.installed)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VENV)/bin/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

parity: install
	$(PY) -m parity run --matrix $(MATRIX) $(PARITY_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

list: install
	$(PY) -m parity list

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
