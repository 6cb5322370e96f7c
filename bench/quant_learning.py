"""Does a quantized base learn? The smoke task on the FP8 or INT4 copy of a GQA, a hybrid and an MLA tiny base.

For each family the shipped tiny base is written quantized (fp8: every linear and expert in 16 x 16 blocks,
`quantize_checkpoint`; int4: the routed experts compressed-tensors pack-quantized in groups of 32, as Kimi-K2.5 ships
them, `pack_checkpoint`) and trained as a user would: `mint train recipes/smoke.toml model.path=<dir>
learner.num_ranks=1 grpo.steps=N`, in its own process; the learner and the built-in rollout engine both load it
quantized (model.quantization auto). One JSON line per family (the run's summary figures), then one with every
family's reward gain.

Run: python bench/quant_learning.py [--quantization fp8|int4] [--families qwen3_moe,qwen3_5_moe,deepseek_v3]
                                    [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from mint.models.quant_checkpoint import pack_checkpoint, quantize_checkpoint
from mint.models.tiny import ensure_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="qwen3_moe,qwen3_5_moe,deepseek_v3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--quantization", choices=("fp8", "int4"), default="fp8")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix=f"{args.quantization}-learning-")
    gains = {}
    for family in args.families.split(","):
        out = os.path.join(work, family)
        if args.quantization == "fp8":
            path = quantize_checkpoint(ensure_tiny(family), out, (16, 16))
        else:
            path = pack_checkpoint(ensure_tiny(family), out, group_size=32)
        cmd = [sys.executable, "-m", "mint.cli", "train", "recipes/smoke.toml", f"model.path={path}",
               "learner.num_ranks=1", f"grpo.steps={args.steps}", f"logging.root={work}/runs", f"logging.name={family}",
               "logging.progress=false"]  # fmt: skip
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{family}: mint train failed:\n{proc.stderr[-3000:]}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        figures = {k: summary[k] for k in ("steps", "reward_first", "reward_last", "reward_gain")}
        print(
            json.dumps(
                {"family": family, "quantization": args.quantization, **figures, "wall_s": round(time.time() - t0, 1)}
            )
        )
        gains[family] = summary["reward_gain"]
    result = {
        "bench": "quant_learning",
        "quantization": args.quantization,
        "steps": args.steps,
        "reward_gain": gains,
        "min_gain": min(gains.values()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
