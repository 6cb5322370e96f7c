"""MinT: adapter revisions, the catalog that indexes them, rollout records and export.

The public API is the names below; the modules behind them are internals (other packages import `mint.hub`, never
its modules, and a test enforces it). MinT stands on its own: it never imports the trainer (`mint.train`) nor the
server (`mint.serve`, which reads revisions through these names).

    Catalog(root)                 open or create a catalog: put, get, resolve, load, latest, lineage, list, tags, gc
    catalog_dir(config)           where a run publishes
    require_local_fs(path)        refuse a network filesystem for the catalog (SQLite WAL)
    RevisionMeta                  a revision's metadata (id, parent, step, run, recipe hash, base, metrics)
    META_FILE                     the name of that metadata's file in a revision or exported directory
    read_revision_dir(path)       a revision directory's tensors and metadata, hash-verified
    write_revision_dir(path, ...) write one (PEFT layout, atomically)
    engine_layout(..., engine)    the layout that engine reads for the base's family: peft or per-expert
    write_adapter_dir(path, ...)  a revision in that layout, atomically: what a rollout actor hands its engine
    read_adapter_dir(path, cfg)   either layout back in the trained one, hash-checked (what `mint serve` loads)
    check_base(meta, base_path)   refuse a base whose fingerprint differs from the revision's
    peft_lora_config(config)      a PEFT LoraConfig from a revision's adapter config
    revision_id(tensors)          sha256 of the canonical tensors: the id
    to_bytes / from_bytes         safetensors bytes of a LoRA state (what crosses Ray)
    base_fingerprint(spec)        identity of a base model's weights
    write_step / read_step        rollout records of one step
    export(catalog, ref, out, fmt) / export_peft(...)
    verify_catalog(catalog, refs) re-hash revisions and record shards against the index (`mint revisions verify`)
    add_parsers / run_command     the `mint revisions | export` CLI

Names resolve lazily, so `import mint.hub` (and `mint --help`) stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Catalog": "mint.hub.catalog",
    "catalog_dir": "mint.hub.catalog",
    "require_local_fs": "mint.hub._fs",
    "RecordShard": "mint.hub._schema",
    "RevisionMeta": "mint.hub.revisions",
    "META_FILE": "mint.hub.revisions",
    "revision_id": "mint.hub.revisions",
    "read_revision_dir": "mint.hub.revisions",
    "write_revision_dir": "mint.hub.revisions",
    "to_bytes": "mint.hub.revisions",
    "from_bytes": "mint.hub.revisions",
    "base_fingerprint": "mint.hub.revisions",
    "write_step": "mint.hub.records",
    "read_step": "mint.hub.records",
    "export": "mint.hub.export",
    "export_peft": "mint.hub.export",
    "engine_layout": "mint.hub.export",
    "write_adapter_dir": "mint.hub.export",
    "read_adapter_dir": "mint.hub.export",
    "check_base": "mint.hub.export",
    "peft_lora_config": "mint.hub.export",
    "verify_catalog": "mint.hub.integrity",
    "add_parsers": "mint.hub.cli",
    "run_command": "mint.hub.cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mint.hub' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
