"""The catalog's SQLite schema, its row types and label rules (private to mint.hub; `Catalog` is the API)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mint.errors import MintError

DB_FILE = "catalog.sqlite"
SCHEMA_VERSION = 1
# gc removes directories the index does not know only when they are older than this: a concurrent publisher renames
# its directory into place a moment before it inserts the entry.
ORPHAN_GRACE_S = 3600.0

_HEX = re.compile(r"^[0-9a-f]+$")
_LABEL = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")
_METRIC = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lora_configs (hash TEXT PRIMARY KEY, json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS revisions (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    parent TEXT,
    created REAL NOT NULL,
    recipe_hash TEXT NOT NULL,
    base_model TEXT NOT NULL,
    base_fingerprint TEXT NOT NULL,
    config_hash TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    stored INTEGER NOT NULL,
    metrics TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS revisions_run_seq ON revisions (run, seq);
CREATE INDEX IF NOT EXISTS revisions_run_step ON revisions (run, step);
CREATE INDEX IF NOT EXISTS revisions_parent ON revisions (parent);
CREATE TABLE IF NOT EXISTS tags (tag TEXT NOT NULL, id TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (tag, id));
CREATE INDEX IF NOT EXISTS tags_id ON tags (id);
CREATE TABLE IF NOT EXISTS names (name TEXT PRIMARY KEY, id TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS names_id ON names (id);
CREATE TABLE IF NOT EXISTS records (
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    revision TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    responses INTEGER NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (run, step, revision)
);
CREATE INDEX IF NOT EXISTS records_revision ON records (revision);
"""

_COLUMNS = (
    "r.id, r.run, r.step, r.parent, r.created, r.recipe_hash, r.base_model, r.base_fingerprint, r.config_hash, "
    "r.metrics, r.nbytes, r.stored"
)
_SELECT = f"SELECT {_COLUMNS} FROM revisions r"


@dataclass(frozen=True)
class GcPlan:
    """What `gc` would do. Build it with `Catalog.plan_gc`, read it, then `Catalog.apply_gc` it."""

    keep_last: int
    keep: tuple[str, ...]  # stored revisions whose tensors stay (N latest per run, tagged, named)
    prune: tuple[str, ...]  # stored revisions whose tensors go; their entries stay
    drop: tuple[str, ...]  # entries removed entirely (only with drop_entries, only without a kept descendant)
    orphans: tuple[str, ...]  # directories under revisions/ with no stored entry, older than ORPHAN_GRACE_S
    bytes_freed: int


@dataclass(frozen=True)
class RecordShard:
    """Index entry of one step's rollout records."""

    run: str
    step: int
    revision: str  # the revision the rollouts were sampled with
    path: str  # relative to the catalog root
    sha256: str
    nbytes: int
    responses: int
    created: float


def check_label(kind: str, label: str) -> str:
    """Tags and names: a letter, then letters, digits, '.', '_' or '-' (at most 64); never something that reads as
    an id prefix or a RUN@STEP ref."""
    if not _LABEL.match(label) or (len(label) >= 6 and _HEX.match(label)):
        raise MintError(f"{kind} {label!r}: use a letter then letters, digits, '.', '_' or '-' (not a hex id prefix)")
    return label
