#!/usr/bin/env bash
# Submit a recipe to a running Ray cluster as a job; extra arguments are dotted overrides.
#   launch/submit.sh recipes/smoke.toml grpo.steps=10
# The job's driver runs in Ray's temporary copy of this checkout, deleted with the job, so the runs go to RUN_ROOT
# (default ./runs), passed as an absolute logging.root: a path the head node writes (shared storage when learner
# ranks span nodes, docs/multinode.md). The environment travels with the job (driver and actors): MINT_CACHE,
# HF_HOME, HF_HUB_OFFLINE, WANDB_MODE, WANDB_API_KEY, PYTHONHASHSEED when set here, plus MINT_ENV="A B" names more.
set -euo pipefail
RECIPE=${1:?usage: launch/submit.sh RECIPE [section.key=value ...]}
shift
RUN_ROOT=$(realpath -m "${RUN_ROOT:-$PWD/runs}")
RUNTIME_ENV=$("${PYTHON:-python3}" -c '
import json, os, sys
names = ["MINT_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "WANDB_MODE", "WANDB_API_KEY", "PYTHONHASHSEED"]
names += os.environ.get("MINT_ENV", "").split()
env = {k: os.environ[k] for k in names if k in os.environ}
print(json.dumps({"working_dir": ".", "excludes": [".venv/", "runs/", ".git/"], "env_vars": env}))
')
ray job submit --address="${RAY_ADDRESS:-http://127.0.0.1:8265}" --runtime-env-json="$RUNTIME_ENV" -- \
  mint train "$RECIPE" ray.address=auto logging.root="$RUN_ROOT" "$@"
