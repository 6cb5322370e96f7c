#!/usr/bin/env bash
# Build a virtualenv from the newest versions pyproject.toml allows, ignoring the lock: what a fresh machine would get
# without requirements.lock. `make lock` freezes it into the lock; `make deps-latest` runs the smoke job and the fast
# suite in it, so an upstream release that breaks Mint is caught here before a user meets it.
#   launch/latest_venv.sh DIR
set -euo pipefail
DIR=${1:?usage: launch/latest_venv.sh DIR}
TORCH=${TORCH-torch==2.13.0}
cd "$(dirname "$0")/.."
rm -rf "$DIR"
"${PY:-python3}" -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
[ -z "$TORCH" ] || "$DIR/bin/python" -m pip install -q "$TORCH"
"$DIR/bin/python" -m pip install -q -e ./kernels -e ".[dev,bench]"
