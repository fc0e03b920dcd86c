# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create .venv when it is missing and install what it lacks; a second run
# installs nothing (the stamp file records the last successful install).

PYTHON ?= python3
# MCORE=<version> (e.g. `make test MCORE=0.19.2`) runs everything against that
# megatron-core release in its own virtualenv, .venv-mcore-<version>; without it
# the default .venv gets the release setup.py picks (0.16.1 on Python 3.11).
MCORE  ?=
ifeq ($(MCORE),)
VENV   ?= .venv
else
VENV   ?= .venv-mcore-$(MCORE)
# The kernels' and collectives' tests never import megatron-core: `make test` runs
# them; another release's run leaves them out (tests/conftest.py marks them).
MCORE_SELECT := -m "not mcore_independent"
endif
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sdp4bit-installed$(if $(MCORE),-$(MCORE))
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

$(STAMP): $(PY) setup.py pyproject.toml scripts/mcore_venv.sh
	@$(PY) -c "import torch" 2>/dev/null \
	  && echo "torch found: $$($(PY) -c 'import torch; print(torch.__version__)') (kept)" \
	  || $(PY) -m pip install -q "$(TORCH_PIN)"
ifeq ($(MCORE),)
	$(PY) -m pip install -q -e ".[test,plots]"
else
	bash scripts/mcore_venv.sh $(PY) $(MCORE)
endif
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(MCORE_SELECT) $(TEST_ARGS)

train: $(STAMP)
	$(PY) -m megatron_sdp4bit.demo $(ARGS)

bench: $(STAMP)
	$(PY) scripts/bench_quant.py
	$(PY) scripts/bench_collectives.py

clean-venv:
	rm -rf $(VENV)
