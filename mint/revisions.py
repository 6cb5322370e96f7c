"""Adapter revisions: immutable LoRA snapshots addressed by the sha256 of their canonical tensors.

A revision on disk is a PEFT adapter directory (`adapter_model.safetensors` + `adapter_config.json`) plus
`mint_revision.json` (id, parent, step, run, recipe hash, metrics). Directories are written to a temporary sibling,
fsynced, and renamed into place, so a reader never sees half a revision.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
META_FILE = "mint_revision.json"


def revision_id(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in key order: each key, dtype, shape, then the raw bytes.

    Canonical means independent of how the file was serialized (header order, padding), so the same adapter
    always gets the same id.
    """
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes: what travels through the Ray object store as the weight sync."""
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_revision_dir(
    target: Path, tensors: dict[str, torch.Tensor], adapter_config: dict[str, Any], meta: dict[str, Any]
) -> str:
    """Write a PEFT-loadable adapter directory atomically; returns the revision id. Existing targets are kept."""
    target = Path(target)
    rev = revision_id(tensors)
    if target.exists():
        return rev
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _fsync_write(tmp / ADAPTER_FILE, to_bytes(tensors))
        _fsync_write(tmp / CONFIG_FILE, json.dumps(adapter_config, indent=2, sort_keys=True).encode())
        record = {"id": rev, "created": time.time(), **meta}
        _fsync_write(tmp / META_FILE, json.dumps(record, indent=2, sort_keys=True).encode())
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return rev
