"""The revision catalog: content-addressed revision directories plus a SQLite index over them.

Layout of a catalog directory (several runs may share one):

    catalog.sqlite                          the index (WAL): revisions, lora configs, tags, names, rollout records
    revisions/<id[:2]>/<id>/                one immutable revision directory each (see mint.hub.revisions)
    records/<run>/step_NNNNNN.<rev>.safetensors   rollout record shards (see mint.hub.records)

An entry is written after its directory is in place, so the index never points at a half-written revision. Files are
read-only once written (directories stay writable for gc). Entries are never edited, except `stored`, which gc clears
when it reclaims a revision's tensors. gc clears it before it touches the directory, and renames the directory aside
(`.<id>.discarded-XXXXXXXX`) before it empties it, so no crash leaves a partial directory under a revision's name; a
publish keeps a directory already there only when its files are whole and hash to the id, and rewrites it otherwise.
Lineage stays whole: gc keeps the entry of every revision that has a kept descendant, so `lineage(id)` of a kept
revision always reaches the root. `mint.hub.integrity` checks the files against
their entries (`mint revisions verify`).

Refs accepted wherever a revision is named: a full id, a name (`tag --name`), `RUN@latest`, `RUN@STEP`, or a unique
id prefix of at least 6 hex digits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mint.errors import MintError
from mint.hub._fs import require_local_fs
from mint.hub._retention import orphan_dirs, retention
from mint.hub._schema import (
    _HEX,
    _METRIC,
    _SCHEMA,
    _SELECT,
    DB_FILE,
    ORPHAN_GRACE_S,  # noqa: F401 - re-exported: gc's grace period, as callers have always read it here
    SCHEMA_VERSION,
    GcPlan,
    RecordShard,
    check_label,
)
from mint.hub.revisions import (
    ADAPTER_FILE,
    RevisionMeta,
    discard_dir,
    file_record,
    publishable_id,
    read_adapter_bytes,
    read_record,
    read_revision_dir,
    recorded_revision,
    same_json,
    write_revision_dir,
)


class Catalog:
    """One catalog directory. Thread-safe (one connection behind a lock); several processes may share it (WAL)."""

    def __init__(self, root: str | Path, create: bool = True):
        self.root = Path(root)
        require_local_fs(self.root)  # SQLite's WAL is unsafe on NFS, Lustre, ... (mint.hub._fs)
        db = self.root / DB_FILE
        if not db.exists() and not create:
            raise MintError(f"{self.root}: no catalog here ({DB_FILE} is missing)")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._configs: dict[str, dict] = {}
        self._db = sqlite3.connect(str(db), timeout=30.0, isolation_level=None, check_same_thread=False)
        # 16 KiB pages (set before the file exists; ignored after): a million-entry bulk index built 27% faster than
        # with 4 KiB pages, since fewer, larger B-tree pages split less under random 64-hex-digit ids.
        self._db.execute("PRAGMA page_size=16384")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # with WAL: the index stays consistent across crashes
        self._db.execute("PRAGMA cache_size=-65536")  # 64 MiB: a million-entry index's hot pages fit
        with self._tx():
            for stmt in _SCHEMA.strip().split(";"):
                if stmt.strip():
                    self._db.execute(stmt)
            row = self._db.execute("SELECT value FROM info WHERE key = 'schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO info VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise MintError(f"{db}: catalog schema {row[0]}, this Mint reads {SCHEMA_VERSION}")

    # ---- plumbing -----------------------------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, params: Iterable = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def revision_dir(self, rid: str) -> Path:
        return self.root / "revisions" / rid[:2] / rid

    def _meta(self, row: tuple) -> RevisionMeta:
        """An index row -> RevisionMeta. LoRA configs are shared by many entries: parsed once, copied per entry."""
        rid, run, step, parent, created, recipe, base, fingerprint, config_hash, metrics, nbytes, stored = row
        config = self._configs.get(config_hash)
        if config is None:
            found = self._query("SELECT json FROM lora_configs WHERE hash = ?", (config_hash,))
            config = self._configs[config_hash] = json.loads(found[0][0]) if found else {}
        return RevisionMeta(
            id=rid,
            run=run,
            step=step,
            parent=parent,
            created=created,
            recipe_hash=recipe,
            base_model=base,
            base_fingerprint=fingerprint,
            lora_config=dict(config),
            metrics=json.loads(metrics),
            nbytes=nbytes,
            stored=bool(stored),
        )

    # ---- writing ------------------------------------------------------------------------------------------------

    def _config_hash(self, db: sqlite3.Connection, lora_config: dict) -> str:
        text = json.dumps(lora_config, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()
        db.execute("INSERT OR IGNORE INTO lora_configs VALUES (?, ?)", (digest, text))
        return digest

    admit = staticmethod(publishable_id)  # the id put() will give tensors; NaN/inf refused in one line

    def put(
        self,
        tensors: dict[str, torch.Tensor],
        lora_config: dict[str, Any],
        *,
        run: str,
        step: int,
        parent: str | None = None,
        recipe_hash: str = "",
        base_model: str = "",
        base_fingerprint: str = "",
        metrics: dict[str, Any] | None = None,
        admitted: str | None = None,
    ) -> RevisionMeta:
        """Publish tensors as a revision and return its entry. Idempotent: the same tensors are the same revision,
        and the first publish's metadata stands. The parent must already be in this catalog (so lineage is acyclic).
        Tensors holding any NaN or inf are refused before anything is written (`admit`); `admitted` is the id `admit`
        already gave these very tensors, whose check and hash are then not done twice. A directory already at the
        revision's place is kept only when it is whole (every file there, the tensors hashing to the id) and
        carries the entry's metadata; anything else there is set aside and the revision written again."""
        rid = admitted or publishable_id(tensors, run, step)
        existing = self.find(rid)
        if existing is not None and existing.stored:
            return existing
        if parent is not None and parent != rid and self.find(parent) is None:
            raise MintError(f"revision {rid[:12]}: parent {parent[:12]} is not in the catalog {self.root}")
        meta = RevisionMeta(
            id=rid,
            run=run,
            step=int(step),
            parent=parent,
            created=time.time(),
            recipe_hash=recipe_hash,
            base_model=base_model,
            base_fingerprint=base_fingerprint,
            lora_config=dict(lora_config),
            # NaN/inf are not JSON: SQLite's json_extract would reject the entry in every metric filter
            metrics={
                k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in (metrics or {}).items()
            },
        )
        target = self.revision_dir(rid)
        first = existing or meta  # tensors reclaimed and published again: the files carry the entry's metadata
        found = recorded_revision(target, rid) if target.exists() else None  # None unless whole (a crash's leftover)
        if existing is None and found is not None and self._known_parent(found):
            first = found  # a first publish killed between its rename and its insert: it wins, as any first publish
        elif found is None or existing is None or not same_json(file_record(found), file_record(existing)):
            discard_dir(target)  # does not count as written: set aside, written afresh, and the index never sees it
        write_revision_dir(target, tensors, first.lora_config, file_record(first), revision=rid)  # keeps a whole one
        if existing is None and not same_json(read_record(target), file_record(first)):
            # A concurrent publish of the same tensors renamed its directory into place first: its metadata wins
            first = recorded_revision(target, rid) or first
        nbytes = (target / ADAPTER_FILE).stat().st_size
        with self._tx() as db:
            if existing is not None:  # tensors reclaimed by gc earlier, published again: they are back
                db.execute("UPDATE revisions SET stored = 1 WHERE id = ?", (rid,))
            else:
                self._insert(db, [dataclasses.replace(first, nbytes=nbytes, stored=True)])
        return self.get(rid)

    def _known_parent(self, meta: RevisionMeta) -> bool:
        return meta.parent is None or meta.parent == meta.id or self.find(meta.parent) is not None

    def _insert(self, db: sqlite3.Connection, metas: Iterable[RevisionMeta]) -> int:
        configs: dict[int, tuple[dict, str]] = {}  # id(config dict) -> (the dict, kept alive; its hash)
        rows = []
        for m in metas:
            key = id(m.lora_config)  # bulk imports share one config object: hash it once, not per entry
            if key not in configs:
                configs[key] = (m.lora_config, self._config_hash(db, m.lora_config))
            rows.append(
                (
                    m.id,
                    m.run,
                    m.step,
                    m.parent,
                    m.created,
                    m.recipe_hash,
                    m.base_model,
                    m.base_fingerprint,
                    configs[key][1],
                    m.nbytes,
                    int(m.stored),
                    json.dumps(m.metrics, sort_keys=True),
                )
            )
        db.executemany(
            "INSERT OR IGNORE INTO revisions (id, run, step, parent, created, recipe_hash, base_model, "
            "base_fingerprint, config_hash, nbytes, stored, metrics) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        return len(rows)

    def index_many(self, metas: Iterable[RevisionMeta]) -> int:
        """Add entries without tensors in one transaction (bulk import, the million-entry benchmark). Entries keep
        their `stored` flag; one marked stored must have its directory in place already. Existing ids are skipped."""
        with self._tx() as db:
            return self._insert(db, metas)

    # ---- reading ------------------------------------------------------------------------------------------------

    def find(self, rid: str) -> RevisionMeta | None:
        rows = self._query(f"{_SELECT} WHERE r.id = ?", (rid,))
        return self._meta(rows[0]) if rows else None

    def resolve(self, ref: str) -> str:
        """The full id a ref names: id, name, RUN@latest, RUN@STEP, or a unique id prefix (>= 6 hex digits)."""
        ref = ref.strip()
        if len(ref) == 64 and _HEX.match(ref):
            if self._query("SELECT 1 FROM revisions WHERE id = ?", (ref,)):
                return ref
            raise MintError(f"revision {ref[:12]}: not in the catalog {self.root}")
        named = self._query("SELECT id FROM names WHERE name = ?", (ref,))
        if named:
            return named[0][0]
        if "@" in ref:
            run, _, at = ref.rpartition("@")
            if at == "latest":
                rows = self._query("SELECT id FROM revisions WHERE run = ? ORDER BY seq DESC LIMIT 1", (run,))
            elif at.isdigit():
                rows = self._query(
                    "SELECT id FROM revisions WHERE run = ? AND step = ? ORDER BY seq DESC LIMIT 1", (run, int(at))
                )
            else:
                rows = []
            if rows:
                return rows[0][0]
            raise MintError(f"revision {ref}: no such run/step in the catalog {self.root}")
        if len(ref) >= 6 and _HEX.match(ref):
            rows = self._query("SELECT id FROM revisions WHERE id >= ? AND id < ? LIMIT 2", (ref, ref + "g"))
            if len(rows) == 1:
                return rows[0][0]
            if len(rows) > 1:
                raise MintError(f"revision {ref}: ambiguous prefix; give more digits")
        raise MintError(f"revision {ref}: not a known id, id prefix, name, or RUN@STEP in the catalog {self.root}")

    def get(self, ref: str) -> RevisionMeta:
        meta = self.find(ref) if len(ref) == 64 else None
        return meta if meta is not None else self.find(self.resolve(ref))  # type: ignore[return-value]

    def _stored(self, ref: str) -> RevisionMeta:
        meta = self.get(ref)
        if not meta.stored:
            raise MintError(f"revision {meta.id[:12]}: its tensors were reclaimed by gc; only the entry is left")
        return meta

    def load(self, ref: str) -> tuple[dict[str, torch.Tensor], RevisionMeta]:
        """The revision's tensors (hash verified) and its entry."""
        meta = self._stored(ref)
        tensors, _, _ = read_revision_dir(self.revision_dir(meta.id), expect_id=meta.id)
        return tensors, meta

    def adapter_bytes(self, ref: str) -> tuple[bytes, RevisionMeta]:
        """The raw bytes of the revision's tensors file (hash verified) and its entry: what a PEFT export copies."""
        meta = self._stored(ref)
        return read_adapter_bytes(self.revision_dir(meta.id), meta.id), meta

    def latest(self, run: str) -> RevisionMeta | None:
        """The most recently published revision of a run."""
        rows = self._query(f"{_SELECT} WHERE r.run = ? ORDER BY r.seq DESC LIMIT 1", (run,))
        return self._meta(rows[0]) if rows else None

    def lineage(self, ref: str, limit: int | None = None) -> list[RevisionMeta]:
        """The revision, its parent, its grandparent... up to the root (or `limit` entries)."""
        rid = self.resolve(ref)
        depth = (limit if limit is not None else 1 << 31) - 1
        rows = self._query(
            f"""WITH RECURSIVE chain(seq, parent, depth) AS (
                    SELECT seq, parent, 0 FROM revisions WHERE id = ?
                    UNION ALL
                    SELECT r.seq, r.parent, chain.depth + 1 FROM revisions r JOIN chain ON r.id = chain.parent
                    WHERE chain.depth < ?
                )
                {_SELECT} JOIN chain ON r.seq = chain.seq ORDER BY chain.depth""",
            (rid, depth),
        )
        return [self._meta(row) for row in rows]

    def children(self, ref: str) -> list[RevisionMeta]:
        return [self._meta(row) for row in self._query(f"{_SELECT} WHERE r.parent = ?", (self.resolve(ref),))]

    def list(
        self,
        run: str | None = None,
        *,
        tag: str | None = None,
        min_step: int | None = None,
        max_step: int | None = None,
        stored: bool | None = None,
        metrics: Iterable[tuple[str, str, float]] = (),
        limit: int | None = 100,
        newest_first: bool = True,
    ) -> list[RevisionMeta]:
        """Entries filtered by run, tag, step range, whether tensors are stored, and metric comparisons such as
        ("reward_mean", ">=", 0.5); newest first by default."""
        where, params = [], []
        if run is not None:
            where.append("r.run = ?")
            params.append(run)
        if tag is not None:
            where.append("r.id IN (SELECT id FROM tags WHERE tag = ?)")
            params.append(tag)
        if min_step is not None:
            where.append("r.step >= ?")
            params.append(min_step)
        if max_step is not None:
            where.append("r.step <= ?")
            params.append(max_step)
        if stored is not None:
            where.append("r.stored = ?")
            params.append(int(stored))
        for key, op, value in metrics:
            if not _METRIC.match(key) or op not in ("<", "<=", "=", ">=", ">", "!="):
                raise MintError(f"metric filter {key}{op}{value}: use NAME OP NUMBER with OP one of < <= = >= > !=")
            where.append(f"json_extract(r.metrics, '$.{key}') {op} ?")
            params.append(float(value))
        sql = _SELECT + (" WHERE " + " AND ".join(where) if where else "")
        sql += f" ORDER BY r.seq {'DESC' if newest_first else 'ASC'}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [self._meta(row) for row in self._query(sql, params)]

    def runs(self) -> list[tuple[str, int]]:
        """(run, number of entries) for every run in the catalog."""
        return [(r, n) for r, n in self._query("SELECT run, COUNT(*) FROM revisions GROUP BY run ORDER BY run")]

    def count(self) -> int:
        return self._query("SELECT COUNT(*) FROM revisions")[0][0]

    # ---- tags and names -----------------------------------------------------------------------------------------

    def tag(self, ref: str, tag: str) -> str:
        """Add a tag (many revisions may share one; a tagged revision's tensors survive gc)."""
        rid, tag = self.resolve(ref), check_label("tag", tag)
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO tags VALUES (?, ?, ?)", (tag, rid, time.time()))
        return rid

    def untag(self, ref: str, tag: str) -> str:
        rid = self.resolve(ref)
        with self._tx() as db:
            db.execute("DELETE FROM tags WHERE tag = ? AND id = ?", (tag, rid))
        return rid

    def tags(self, ref: str | None = None) -> list[tuple[str, str]]:
        """(tag, id) pairs, of one revision or of all."""
        if ref is None:
            return [tuple(r) for r in self._query("SELECT tag, id FROM tags ORDER BY tag, created")]
        return [
            tuple(r) for r in self._query("SELECT tag, id FROM tags WHERE id = ? ORDER BY tag", (self.resolve(ref),))
        ]

    def name(self, name: str, ref: str) -> str:
        """Point a unique name at a revision (moving it if it named another); serving and export accept names."""
        rid, name = self.resolve(ref), check_label("name", name)
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO names VALUES (?, ?, ?)", (name, rid, time.time()))
        return rid

    def unname(self, name: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM names WHERE name = ?", (name,))

    def names(self, ref: str | None = None) -> dict[str, str]:
        """name -> id, of one revision or of all."""
        if ref is None:
            return dict(self._query("SELECT name, id FROM names ORDER BY name"))
        return dict(self._query("SELECT name, id FROM names WHERE id = ? ORDER BY name", (self.resolve(ref),)))

    # ---- rollout records index ----------------------------------------------------------------------------------

    def add_records(self, shard: RecordShard) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?)", dataclasses.astuple(shard))

    def records(
        self, *, run: str | None = None, revision: str | None = None, step: int | None = None
    ) -> list[RecordShard]:
        """Record shards by run, by the revision they were sampled with, and/or by step; in step order."""
        where, params = [], []
        for col, value in (("run", run), ("revision", revision), ("step", step)):
            if value is not None:
                where.append(f"{col} = ?")
                params.append(self.resolve(value) if col == "revision" else value)
        sql = "SELECT * FROM records" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY step, created"
        return [RecordShard(*row) for row in self._query(sql, params)]

    # ---- retention ----------------------------------------------------------------------------------------------

    def plan_gc(self, keep_last: int, run: str | None = None, drop_entries: bool = False) -> GcPlan:
        """Keep the tensors of each run's `keep_last` latest revisions plus every tagged or named one; reclaim the
        rest. keep_last = 0 keeps every revision. Entries stay (lineage never dangles); with drop_entries, entries of
        revisions that have no kept descendant (dead branches) are removed too. A revision with a kept child is
        never dropped."""
        if keep_last < 0:
            raise MintError(f"gc: keep_last must be >= 0, got {keep_last}")
        whole = run is None or drop_entries  # dropping needs every run's kept revisions; pruning one run does not
        sql = "SELECT id, run, parent, stored, nbytes FROM revisions" + ("" if whole else " WHERE run = ?")
        rows = self._query(sql + " ORDER BY seq", () if whole else (run,))
        tagged = {r[0] for r in self._query("SELECT id FROM tags UNION SELECT id FROM names")}
        keep, prune, drop, freed = retention(rows, tagged, keep_last, run, drop_entries)
        orphans = orphan_dirs(
            self.root, lambda rid: bool(self._query("SELECT 1 FROM revisions WHERE id = ? AND stored", (rid,)))
        )
        return GcPlan(keep_last, tuple(sorted(keep)), tuple(prune), tuple(drop), tuple(orphans), freed)

    def apply_gc(self, plan: GcPlan) -> GcPlan:
        """Carry out a plan: entries change first (in one transaction), then directories go, each renamed aside
        before it is emptied (`discard_dir`). A crash in between leaves a whole orphan directory or a hidden one set
        aside, never a partial directory under a revision's name; the next gc removes them."""
        with self._tx() as db:
            db.executemany("UPDATE revisions SET stored = 0 WHERE id = ?", [(rid,) for rid in plan.prune])
            db.executemany("DELETE FROM revisions WHERE id = ?", [(rid,) for rid in plan.drop])
            db.executemany("DELETE FROM tags WHERE id = ?", [(rid,) for rid in plan.drop])
        for rid in (*plan.prune, *plan.drop):
            discard_dir(self.revision_dir(rid))
        for rel in plan.orphans:
            discard_dir(self.root / rel)
        return plan

    def gc(self, keep_last: int, run: str | None = None, drop_entries: bool = False) -> GcPlan:
        return self.apply_gc(self.plan_gc(keep_last, run, drop_entries))


def catalog_dir(config) -> Path:
    """Where a run publishes: the recipe's `catalog.path`, or <run dir>/catalog when that is empty."""
    from mint.config import run_dir

    return Path(config.catalog.path) if config.catalog.path else run_dir(config) / "catalog"
