"""What gc keeps and reclaims (private to mint.hub; `Catalog.plan_gc` / `apply_gc` are the API): the rule over the
index's rows, and the scan for directories no stored entry owns."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from mint.hub._schema import ORPHAN_GRACE_S
from mint.hub.revisions import DISCARDED


def retention(
    rows: list[tuple], tagged: set[str], keep_last: int, run: str | None, drop_entries: bool
) -> tuple[set[str], list[str], list[str], int]:
    """(keep, prune, drop, bytes freed) for index rows (id, run, parent, stored, nbytes) in publish order: each run's
    `keep_last` latest revisions (all with 0) and the tagged or named ones are kept; the stored rest of `run` (or of
    every run) is pruned; with drop_entries, the entries no kept revision descends from are dropped."""
    info = {rid: (r_run, parent, bool(stored), nbytes) for rid, r_run, parent, stored, nbytes in rows}
    keep = tagged & set(info)
    by_run: dict[str, list[str]] = {}
    for rid, r_run, *_ in rows:
        by_run.setdefault(r_run, []).append(rid)
    for ids in by_run.values():  # every run counts for what is kept; only `run` is pruned
        keep.update(ids if keep_last == 0 else ids[-keep_last:])
    scope = [rid for rid, r_run, *_ in rows if run is None or r_run == run]
    prune = [rid for rid in scope if info[rid][2] and rid not in keep]
    drop: list[str] = []
    if drop_entries:
        needed: set[str] = set()  # kept revisions and all their ancestors: the entries lineage walks need
        for rid in keep:
            while rid is not None and rid in info and rid not in needed:
                needed.add(rid)
                rid = info[rid][1]
        drop = [rid for rid in scope if rid not in needed]
    freed = sum(info[rid][3] for rid in set(prune) | {rid for rid in drop if info[rid][2]})
    return keep, prune, drop, freed


def orphan_dirs(root: Path, stored: Callable[[str], bool]) -> list[str]:
    """Directories under root/revisions/ (relative to root) that no stored entry owns: a temporary one of a crashed
    write or one without a stored entry, once older than ORPHAN_GRACE_S, and one a crashed delete set aside, at once
    (nothing will read it)."""
    base = root / "revisions"
    if not base.is_dir():
        return []
    cutoff = time.time() - ORPHAN_GRACE_S
    out = []
    for shard in base.iterdir():
        for d in shard.iterdir() if shard.is_dir() else ():
            if DISCARDED in d.name or (d.stat().st_mtime <= cutoff and (d.name.startswith(".") or not stored(d.name))):
                out.append(str(d.relative_to(root)))
    return sorted(out)
