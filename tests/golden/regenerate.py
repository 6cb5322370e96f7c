"""Rewrite the golden figures, tests/golden/<base>.json, from fresh golden runs: `make golden`, or

    .venv/bin/python tests/golden/regenerate.py [BASE ...] [--runs N]

Only after a change meant to move the numbers (the commit message says which change and why). Each base runs N
times (default 2) and its file is written only when every run gives the same figures bit for bit and every Ray worker
ran with the pinned float kernels, so a nondeterministic change cannot be pinned. For each base it prints the first
figure that moved against the old file. Exits 1 when any base was not written.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from harness import BASES, differences, golden_file, run_golden, unpinned_workers, write_golden


def regenerate(base: str, runs: int) -> str | None:
    """Run tiny:<base> `runs` times and write its golden file; the reason it was not written, else None."""
    figs, seconds = [], []
    for i in range(runs):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"mint-golden-{base}-") as root:
            fig = run_golden(base, Path(root))
        seconds.append(time.perf_counter() - t0)
        problems = unpinned_workers(fig)
        if problems:
            return "; ".join(problems)
        if figs and (diffs := differences(figs[0], fig, exact=True)):
            return f"run {i + 1} differs from run 1 ({len(diffs)} figures), first at {diffs[0]}"
        figs.append(fig)
    old = golden_file(base)
    change = "a new file"
    if old.exists():
        # Bit for bit against the old file; figures the old file did not have yet are listed, not compared.
        before = json.loads(old.read_text())
        known = {k for s in before.get("steps", []) for k in s}
        added = sorted({k for s in figs[0]["steps"] for k in s} - known)
        now = figs[0] | {"steps": [{k: v for k, v in s.items() if k in known} for s in figs[0]["steps"]]}
        moved = differences(before, now, exact=True)
        change = f"{len(moved)} figures moved bit for bit" + (f", first {moved[0]}" if moved else "")
        change += f"; new figures {added}" if added else ""
    path = write_golden(base, figs[0])
    runs_s = ", ".join(f"{s:.0f}" for s in seconds)
    print(f"tiny:{base}: wrote {path} ({runs} runs agree, {runs_s} s); {change}")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bases", nargs="*", metavar="BASE", help=f"tiny bases to rewrite (default all: {BASES})")
    parser.add_argument("--runs", type=int, default=2, help="runs per base that must agree bit for bit (default 2)")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.bases) - set(BASES)):
        parser.error(f"unknown base {unknown}; choose from {', '.join(BASES)}")
    failed = {}
    for base in args.bases or BASES:
        try:
            reason = regenerate(base, max(args.runs, 1))
        except Exception as err:  # a failed run: report it, and still regenerate the other bases
            reason = f"{type(err).__name__}: {err}"
        if reason:
            failed[base] = reason
            print(f"tiny:{base}: NOT written: {reason}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
