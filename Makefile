# Two commands a newcomer needs:
#   make train   set up .venv (first use only) and train the default model on the embedded corpus
#   make test    set up both environments (first use only) and run the whole suite in each
# and `make finetune`: full SFT of a small Hugging Face folder built locally, on a local chat JSONL.
#
# Two environments, one codebase:
#   .venv      the newest torch (GPU / CPU users): train, bench, the whole suite without XLA tests
#   .venv-xla  torch 2.9.0 + torch_xla 2.9.0 (TPU users): the whole suite, XLA tests included
PYTHON   ?= python3
VENV     := .venv
VENV_XLA := .venv-xla
PY       := $(VENV)/bin/python
PY_XLA   := $(VENV_XLA)/bin/python
# torch_xla wheels exist for Linux x86-64 only: elsewhere the [xla] extra installs torch 2.9 without
# it and the XLA tests skip; on Linux x86-64 a skipped XLA test fails the run (EMBER_REQUIRE_XLA=1).
XLA_PLATFORM := $(shell $(PYTHON) -c "import platform,sys; print(int(sys.platform=='linux' and platform.machine()=='x86_64'))")
PYTEST_ARGS ?=
# The two torch lines with their CUDA wheels take ~15 GB; pip's wheel cache would add ~8 GB more
# (a CI disk once filled up): the large installs skip it.

.PHONY: install install-xla test test-latest test-xla train finetune bench clean

$(VENV)/.ember-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-cache-dir --upgrade -e ".[test]" torch
	$(PY) -m pip uninstall --quiet --yes torch_xla  # a .venv made before the split had it
	touch $@

$(VENV_XLA)/.ember-installed: pyproject.toml
	test -x $(PY_XLA) || $(PYTHON) -m venv $(VENV_XLA)
	$(PY_XLA) -m pip install --quiet --upgrade pip
	$(PY_XLA) -m pip install --quiet --no-cache-dir -e ".[xla,test]"
	touch $@

install: $(VENV)/.ember-installed
install-xla: $(VENV_XLA)/.ember-installed

test: test-latest test-xla

# XLA tests are deselected by marker here (pytest reports them as deselected, not skipped).
test-latest: install
	$(PY) -m pytest -m "not xla" $(PYTEST_ARGS)

test-xla: install-xla
	EMBER_REQUIRE_XLA=$(XLA_PLATFORM) $(PY_XLA) -m pytest $(PYTEST_ARGS)

train: install
	$(PY) launch/train.py --overwrite  # the default run replaces the last one in runs/default

# Fine-tune a Hugging Face folder built here (random init, local tokenizer and chat data) on its chat JSONL.
finetune: install
	$(PY) launch/tiny_chat.py --out runs/tiny_chat
	$(PY) launch/train.py --config tiny_chat_sft --overwrite

bench: install
	$(PY) launch/bench.py --quick

clean:
	rm -rf $(VENV) $(VENV_XLA) *.egg-info .pytest_cache
