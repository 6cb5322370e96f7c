#!/usr/bin/env bash
# Start Ray on this node: the head when HEAD_ADDR is unset, else a worker joining HEAD_ADDR.
#   head:    launch/ray_up.sh                      (WAIT_NODES=4 WAIT_GPUS=32: then wait until they joined)
#   worker:  HEAD_ADDR=10.0.0.1 launch/ray_up.sh
# Extra arguments go to `ray start` (SLURM passes --block so the step holds the daemons; the wait is then
# slurm.sbatch's). A worker waits up to $MINT_WAIT_S (300) seconds for the head's port before it joins.
# Every node needs the same checkout with `make setup` done (or the package installed in its Python). The daemon's
# environment is its actors' environment: MINT_CACHE (where this node keeps tiny bases) and HF_HOME apply per node.
set -euo pipefail
PORT=${RAY_PORT:-6379}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -z "${HEAD_ADDR:-}" ]; then
  ray start --head --port="$PORT" --num-gpus="$GPUS" --dashboard-host=0.0.0.0 "$@"
  if [ -n "${WAIT_NODES:-}" ]; then  # reached only without --block
    bash "$HERE/wait_for_nodes.sh" "$(hostname --ip-address | awk '{print $1}'):$PORT" "$WAIT_NODES" "${WAIT_GPUS:-0}"
  fi
else
  for _ in $(seq "${MINT_WAIT_S:-300}"); do
    (exec 3<>"/dev/tcp/$HEAD_ADDR/$PORT") 2>/dev/null && break
    sleep 1
  done
  ray start --address="$HEAD_ADDR:$PORT" --num-gpus="$GPUS" "$@"
fi
