"""Checking a catalog against itself: `verify_catalog`, behind `mint revisions verify` (an fsck for the catalog).

For every revision entry whose tensors are stored, it checks that

    - the directory and its three files exist, and the JSON files parse;
    - adapter_model.safetensors parses, its size is the entry's `nbytes`, its tensors hash to the id, and they hold
      no NaN or inf (`Catalog.put` refuses those; one found here was published before that rule or written by hand);
    - adapter_config.json is the entry's LoRA config, and mint_revision.json carries the entry's metadata.

For every rollout-record shard (of the named revisions, or all), it checks the file exists, has the recorded size and
hashes to the recorded sha256. Entries whose tensors gc reclaimed (stored = 0) are reported as pruned, not as bad.
Checking everything costs one read of every stored byte: about a second per GB.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file as st_load_file

from mint.hub._schema import DB_FILE
from mint.hub.catalog import Catalog
from mint.hub.revisions import (
    ADAPTER_FILE,
    CONFIG_FILE,
    META_FILE,
    RevisionMeta,
    _one_line,
    describe_nonfinite,
    nonfinite_counts,
    revision_id,
)

# mint_revision.json fields that must equal the entry's (nbytes and stored live only in the index).
_META_FIELDS = ("id", "run", "step", "parent", "created", "recipe_hash", "base_model", "base_fingerprint", "metrics")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Problem:
    """One finding: a bad revision entry or record shard, or a pruned entry (not an error)."""

    kind: str  # "revision", "records" or "index"
    revision: str  # the revision id (for records: the revision that sampled them); "" for the index
    status: str  # "bad" or "pruned"
    what: str  # one line: what is wrong (for records, it names the shard's path)

    @property
    def bad(self) -> bool:
        return self.status == "bad"

    def line(self) -> str:
        return f"{self.revision[:12] or self.kind:<12}  {self.status:<6}  {self.what}"


@dataclass(frozen=True)
class Verification:
    """What `verify_catalog` checked and found."""

    revisions: int  # entries checked (pruned ones included)
    shards: int  # record shards checked
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not any(p.bad for p in self.problems)

    def summary(self) -> str:
        def count(kind: str, status: str) -> int:
            return sum(p.kind == kind and p.status == status for p in self.problems)

        bad_revs, pruned = count("revision", "bad"), count("revision", "pruned")
        bad_shards, bad_index = count("records", "bad"), count("index", "bad")
        good_revs = self.revisions - bad_revs - pruned
        text = (
            f"verified {self.revisions} revisions ({good_revs} ok, {bad_revs} bad, {pruned} pruned) and "
            f"{self.shards} record shards ({self.shards - bad_shards} ok, {bad_shards} bad)"
        )
        if bad_index:
            text += "; the index is damaged"
        return text + (": all good" if self.ok else ": CORRUPT")


def verify_catalog(catalog: Catalog, refs: Iterable[str] | None = None) -> Verification:
    """Check the named revisions and their record shards, or (refs None) every entry, every shard and the SQLite
    index itself. An unknown ref raises MintError before anything is checked."""
    problems: list[Problem] = []
    if refs is None:
        problems += _check_index(catalog.root)
        metas = catalog.list(limit=None, newest_first=False)
        shards = catalog.records()
    else:
        ids = list(dict.fromkeys(catalog.resolve(ref) for ref in refs))
        metas = [catalog.get(rid) for rid in ids]
        shards = [s for rid in ids for s in catalog.records(revision=rid)]
    for meta in metas:
        problem = check_revision(catalog, meta)
        if problem is not None:
            problems.append(problem)
    for shard in shards:
        what = _check_shard(catalog.root / shard.path, shard.sha256, shard.nbytes)
        if what:
            problems.append(Problem("records", shard.revision, "bad", f"rollout records {shard.path}: {what}"))
    return Verification(len(metas), len(shards), tuple(problems))


def check_revision(catalog: Catalog, meta: RevisionMeta) -> Problem | None:
    """None when the entry's files are whole and agree with it; a Problem (bad, or pruned) otherwise."""
    if not meta.stored:
        return Problem("revision", meta.id, "pruned", "tensors reclaimed by gc; the entry stays for lineage")
    wrong = _revision_faults(catalog.revision_dir(meta.id), meta)
    return Problem("revision", meta.id, "bad", "; ".join(wrong)) if wrong else None


def _revision_faults(path: Path, meta: RevisionMeta) -> list[str]:
    if not path.is_dir():
        return [f"directory {path} is missing"]
    missing = [name for name in (ADAPTER_FILE, CONFIG_FILE, META_FILE) if not (path / name).is_file()]
    if missing:
        return [f"{', '.join(missing)} missing"]
    wrong = []
    size = (path / ADAPTER_FILE).stat().st_size
    if size != meta.nbytes:
        wrong.append(f"{ADAPTER_FILE} is {size} bytes, the index says {meta.nbytes}")
    try:
        tensors = st_load_file(str(path / ADAPTER_FILE))
    except Exception as err:  # safetensors raises its own error type for a truncated or garbled file
        wrong.append(f"{ADAPTER_FILE} does not parse ({_one_line(err)})")
    else:
        actual = revision_id(tensors)
        if actual != meta.id:
            wrong.append(f"tensors hash to {actual[:12]}, not to the id")
        bad = nonfinite_counts(tensors)
        if bad:
            wrong.append(describe_nonfinite(bad))
    config, problem = _read_json(path / CONFIG_FILE)
    if problem:
        wrong.append(problem)
    elif _norm(config) != _norm(meta.lora_config):
        wrong.append(f"{CONFIG_FILE} differs from the index's LoRA config")
    record, problem = _read_json(path / META_FILE)
    if problem:
        wrong.append(problem)
    else:
        entry = meta.to_dict()
        differ = [k for k in _META_FIELDS if _norm(record.get(k)) != _norm(entry[k])]
        if _norm(record.get("lora_config")) != _norm(meta.lora_config):
            differ.append("lora_config")
        if differ:
            wrong.append(f"{META_FILE} differs from the index in {', '.join(differ)}")
    return wrong


def _read_json(path: Path) -> tuple[dict[str, Any], str]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return {}, f"{path.name} does not parse ({_one_line(err)})"
    if not isinstance(value, dict):
        return {}, f"{path.name} is not a JSON object"
    return value, ""


def _check_shard(path: Path, sha256: str, nbytes: int) -> str:
    """'' when the shard is whole, else what is wrong with it."""
    h, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if size != nbytes:
        return f"{size} bytes, the index says {nbytes}"
    if h.hexdigest() != sha256:
        return f"hashes to {h.hexdigest()[:12]}, the index says {sha256[:12]}"
    return ""


def _check_index(root: Path) -> list[Problem]:
    """SQLite's own check of the index file (b-trees, free lists, index entries against rows), on a read-only
    connection of its own."""
    db = sqlite3.connect(f"{(root / DB_FILE).resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
    try:
        found = [r[0] for r in db.execute("PRAGMA quick_check").fetchall() if r[0] != "ok"]
    except sqlite3.DatabaseError as err:
        found = [_one_line(err)]
    finally:
        db.close()
    return [Problem("index", "", "bad", f"{DB_FILE}: {found[0]} ({len(found)} faults)")] if found else []


def _norm(value: Any) -> Any:
    """A value as JSON gives it back, so tuples and lists, or 1 and 1.0, compare as the files store them."""
    return json.loads(json.dumps(value, sort_keys=True))
