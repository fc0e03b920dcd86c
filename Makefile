# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create .venv when it is missing and install what it lacks; a second run
# installs nothing (the stamp file records the last successful install).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sdp4bit-installed
# torch is installed only when it is not importable, and then pinned to the CPU
# build that lies on this kind of machine: an unpinned torch pulls a CUDA build
# of several GB, and a user's GPU box keeps the torch it has.
TORCH_PIN ?= torch==2.13.0
ARGS ?=
TEST_ARGS ?=

.PHONY: setup test train bench clean-venv

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV) || $(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) setup.py pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null \
	  && echo "torch found: $$($(PY) -c 'import torch; print(torch.__version__)') (kept)" \
	  || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,plots]"
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(TEST_ARGS)

train: $(STAMP)
	$(PY) -m megatron_sdp4bit.demo $(ARGS)

bench: $(STAMP)
	$(PY) scripts/bench_quant.py
	$(PY) scripts/bench_collectives.py

clean-venv:
	rm -rf $(VENV)
