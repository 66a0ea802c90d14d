# Two commands a newcomer needs:
#   make train   set up .venv (first use only) and train the default model on the embedded corpus
#   make test    set up .venv (first use only) and run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ember-installed
# torch_xla wheels exist for Linux x86-64 only: elsewhere the [xla] extra installs nothing and the
# XLA tests skip; on Linux x86-64 a skipped XLA test fails the run (EMBER_REQUIRE_XLA=1).
XLA_PLATFORM := $(shell $(PYTHON) -c "import platform,sys; print(int(sys.platform=='linux' and platform.machine()=='x86_64'))")
PYTEST_ARGS ?=

.PHONY: install test train bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[xla,test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	EMBER_REQUIRE_XLA=$(XLA_PLATFORM) $(PY) -m pytest $(PYTEST_ARGS)

train: $(STAMP)
	$(PY) launch/train.py

bench: $(STAMP)
	$(PY) launch/bench.py --quick

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
