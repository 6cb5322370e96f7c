#!/usr/bin/env bash
# Start Ray on this node: the head when HEAD_ADDR is unset, else a worker joining HEAD_ADDR.
#   head:    launch/ray_up.sh
#   worker:  HEAD_ADDR=10.0.0.1 launch/ray_up.sh
# Extra arguments go to `ray start` (SLURM passes --block so the step holds the daemons).
# Every node needs the same checkout with `make setup` done (or the package installed in its Python).
set -euo pipefail
PORT=${RAY_PORT:-6379}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)}
if [ -z "${HEAD_ADDR:-}" ]; then
  ray start --head --port="$PORT" --num-gpus="$GPUS" --dashboard-host=0.0.0.0 "$@"
else
  ray start --address="$HEAD_ADDR:$PORT" --num-gpus="$GPUS" "$@"
fi
