"""Multi-turn episodes in the learner: LongStraw's peak memory against the naive step on episodes of 1, 4 and 16 turns.

Usage:
    python bench/agentic.py                                    # P=1024, G=4, 16-token actions, 48-token observations
    python bench/agentic.py --turns 1,4,16 --prompt-len 4096 --device cuda --dtype bfloat16

An episode reaches the learner as its shared prompt (the initial observation, captured once) and G tails of
T = turns x action + (turns - 1) x observation tokens, every one of them replayed with autograd (observation tokens
carry no loss but later tokens attend to them), so for memory a tail is a response of T tokens: the loss mask changes
which tokens weigh, not what is kept. Each turn count runs bench/longstraw_memory.py's workers (a fresh process per
configuration, measured peak against the bound M_prefix + M_dkv + M_grad + the largest replay term) for the naive
step and LongStraw exact, which compute the same gradient.

Reported per turn count: both peaks, naive_over_exact_memory, and exact's peak_over_bound (the memory model says
LongStraw's peak follows the longest tail, not the prompt plus all tails). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", default="1,4,16", help="turn counts, comma-separated")
    ap.add_argument("--action-len", type=int, default=16, help="tokens sampled per turn")
    ap.add_argument("--observation-len", type=int, default=48, help="tokens of each observation between turns")
    ap.add_argument("--prompt-len", type=int, default=1024, help="P: the initial observation")
    ap.add_argument("--group", type=int, default=4, help="G episodes per group")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunk", type=int, default=256)
    return ap.parse_args(argv)


def tail_len(turns: int, action: int, observation: int) -> int:
    return turns * action + (turns - 1) * observation


def measure(args, turns: int) -> dict:
    """bench/longstraw_memory.py's naive and exact workers on tails of this many turns: its summary line."""
    T = tail_len(turns, args.action_len, args.observation_len)
    cmd = [
        sys.executable, os.path.join(HERE, "longstraw_memory.py"),
        "--configs", "naive,exact", "--flat-groups", "",
        "--prompt-len", str(args.prompt_len), "--group", str(args.group), "--response-len", str(T),
        "--chunk", str(args.chunk), "--device", args.device, "--dtype", args.dtype,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return {"turns": turns, "tail_tokens": T, "error": f"exit {proc.returncode}"}
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = {r["config"]: r for r in summary.get("runs", [])}
    return {
        "turns": turns,
        "tail_tokens": T,
        "naive_peak_bytes": runs.get("naive", {}).get("peak_bytes"),
        "exact_peak_bytes": runs.get("exact", {}).get("peak_bytes"),
        "exact_bound_bytes": runs.get("exact", {}).get("bound_bytes"),
        "naive_over_exact_memory": summary["naive_over_exact_memory"],
        "exact_peak_over_bound": summary["peak_over_bound_exact"],
        "peak_note": summary["peak_note"],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    results = [measure(args, int(t)) for t in args.turns.split(",")]
    for r in results:
        if "error" in r:
            print(f"{r['turns']:3d} turns ({r['tail_tokens']} tail tokens): {r['error']}")
            continue
        print(
            f"{r['turns']:3d} turns ({r['tail_tokens']:5d} tail tokens): naive/exact memory "
            f"{r['naive_over_exact_memory']}, exact peak/bound {r['exact_peak_over_bound']}"
        )
    most = max((r for r in results if "error" not in r), key=lambda r: r["turns"], default=None)
    print(
        json.dumps(
            {
                "by_turns": results,
                "exact_peak_over_bound_at_most_turns": most["exact_peak_over_bound"] if most else None,
                "P": args.prompt_len,
                "G": args.group,
                "action_len": args.action_len,
                "observation_len": args.observation_len,
                "device": args.device,
                "dtype": args.dtype,
            }
        )
    )


if __name__ == "__main__":
    main()
