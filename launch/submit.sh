#!/usr/bin/env bash
# Submit a recipe to a running Ray cluster as a job; extra arguments are dotted overrides.
#   launch/submit.sh recipes/smoke.toml grpo.steps=10
set -euo pipefail
RECIPE=${1:?usage: launch/submit.sh RECIPE [section.key=value ...]}
shift
ray job submit --address="${RAY_ADDRESS:-http://127.0.0.1:8265}" --working-dir=. -- \
  mint train "$RECIPE" ray.address=auto "$@"
