#!/usr/bin/env bash
# Wait until the Ray cluster at HOST:PORT has NODES nodes and GPUS GPUs in all (the head included), or fail after
# TIMEOUT_S seconds (default $MINT_WAIT_S, else 300) with one line naming what joined and what is missing.
#   launch/wait_for_nodes.sh 10.0.0.1:6379 4 32 600
# slurm.sbatch and ray_up.sh call it; it is `python -m mint.train.nodes wait` ($PYTHON: the Python with mint).
set -euo pipefail
ADDRESS=${1:?usage: launch/wait_for_nodes.sh HOST:PORT NODES [GPUS] [TIMEOUT_S]}
NODES=${2:?usage: launch/wait_for_nodes.sh HOST:PORT NODES [GPUS] [TIMEOUT_S]}
GPUS=${3:-0}
TIMEOUT=${4:-${MINT_WAIT_S:-300}}
exec "${PYTHON:-python}" -m mint.train.nodes wait --address "$ADDRESS" --nodes "$NODES" --gpus "$GPUS" --timeout "$TIMEOUT"
