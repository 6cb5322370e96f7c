"""Adapter revisions: immutable LoRA snapshots addressed by the sha256 of their canonical tensors.

A revision on disk is a PEFT adapter directory plus Mint's metadata:

    adapter_model.safetensors   the LoRA tensors, under PEFT's saved names
    adapter_config.json         PEFT's LoraConfig, so `PeftModel.from_pretrained(base, dir)` loads it unchanged
    mint_revision.json          id, parent, step, run, recipe hash, base model + fingerprint, metrics, created

Writes go to a temporary sibling directory; every file is fsynced and made read-only (0o444), the directory is renamed
into place, and the parent directory is fsynced, so a reader sees a whole revision or none. The directory itself stays
writable, so gc can delete it. Deletes go the other way (`discard_dir`): the directory is renamed to a hidden sibling
first and emptied there, so no crash leaves part of a revision under its own name. Reads recompute the id from the
tensors and refuse a file whose hash differs or that does not parse (a partial or corrupt write) with a one-line
`MintError`.

The index over many revisions (lineage, tags, latest per run) is `mint.hub.catalog`; this module is the file format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file

from mint.errors import MintError

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
META_FILE = "mint_revision.json"
# The infix of a directory being deleted (`.NAME.discarded-XXXXXXXX`, a hidden sibling): nothing reads it, and gc
# removes one that a crash left behind at once, without the grace period a temporary directory of a write gets.
DISCARDED = ".discarded-"
# Files in a catalog are never written again once in place. Read-only says so to every tool that opens them; it does not
# stop root (tests run as root), which is why exports copy instead of hard-linking: see export_peft.
READ_ONLY = 0o444

# Base fingerprint: this many tensors, evenly spaced over the sorted names, each hashed over its first 16 MiB. Reading
# 8 x 16 MiB costs well under a second even for a 60 GB checkpoint, and a changed or re-quantized base still changes
# the config or one of those prefixes.
FINGERPRINT_TENSORS = 8
FINGERPRINT_BYTES = 16 << 20
# config.json keys that say nothing about the weights (they change when the same weights are re-saved).
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")


def revision_id(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in key order: each key, dtype, shape, then the raw bytes.

    Canonical means independent of how the file was serialized (header order, padding), so the same adapter
    always gets the same id.
    """
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))  # hashed in place: no bytes copy of a large tensor
    return h.hexdigest()


def nonfinite_counts(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """key -> number of NaN or inf values, for the tensors that hold any, in key order (the order of the id)."""
    out = {}
    for key in sorted(tensors):
        t = tensors[key].detach()
        if t.is_floating_point() or t.is_complex():
            n = int(torch.isfinite(t).logical_not().sum().item())
            if n:
                out[key] = n
    return out


def describe_nonfinite(counts: dict[str, int]) -> str:
    """One phrase for `nonfinite_counts`: the total, and the first tensor (in key order) that holds any."""
    first = next(iter(counts))
    return f"{sum(counts.values()):,} non-finite values (NaN or inf), first in {first} ({counts[first]:,})"


def publishable_id(tensors: dict[str, torch.Tensor], run: str, step: int) -> str:
    """The id these tensors publish under; one line, before anything is written, for any NaN or inf."""
    bad = nonfinite_counts(tensors)
    if bad:  # a diverged update: serving or resuming from it can only spread the NaNs
        raise MintError(f"run {run} step {step}: refusing to publish {describe_nonfinite(bad)}; nothing written")
    return revision_id(tensors)


def to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes: what travels through the Ray object store as the weight sync."""
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)


@dataclass(frozen=True)
class RevisionMeta:
    """Everything Mint knows about one revision besides its tensors. Immutable once published."""

    id: str  # sha256 of the canonical tensors (`revision_id`)
    run: str  # run name (logging.name) that published it
    step: int  # optimizer steps behind it; 0 is the initial adapter
    parent: str | None  # the revision it was trained from (the one whose rollouts produced this update)
    created: float  # unix time of the first publish
    recipe_hash: str = ""  # Config.digest() of the run
    base_model: str = ""  # the model spec of the run (hub id, path, or tiny:<family>)
    base_fingerprint: str = ""  # `base_fingerprint` of the resolved base
    lora_config: dict[str, Any] = field(default_factory=dict)  # adapter_config.json content
    metrics: dict[str, Any] = field(default_factory=dict)  # the step's metrics (reward_mean, loss, ...)
    nbytes: int = 0  # size of adapter_model.safetensors
    stored: bool = True  # False once gc reclaimed the tensors (the entry and its lineage stay)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RevisionMeta:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a crash (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_revision_dir(
    target: Path,
    tensors: dict[str, torch.Tensor],
    adapter_config: dict[str, Any],
    meta: dict[str, Any],
    revision: str | None = None,
) -> str:
    """Write a PEFT-loadable revision directory atomically; returns the revision id. An existing target is kept.

    `meta` is stored in mint_revision.json with `id` (and `created`, unless given) added. The id is `revision` when
    given (a caller that has just hashed or verified the tensors, or the trained revision of a re-layout such as the
    per-expert split, whose own tensors hash differently), else the tensors' hash.
    """
    target = Path(target)
    rev = revision or revision_id(tensors)
    if target.exists():
        return rev
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        st_save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_FILE))
        _fsync_file(tmp / ADAPTER_FILE)
        _fsync_write(tmp / CONFIG_FILE, json.dumps(adapter_config, indent=2, sort_keys=True).encode())
        record = {"created": time.time(), **meta, "id": rev}
        _fsync_write(tmp / META_FILE, json.dumps(record, indent=2, sort_keys=True).encode())
        for name in (ADAPTER_FILE, CONFIG_FILE, META_FILE):
            os.chmod(tmp / name, READ_ONLY)
        fsync_dir(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / META_FILE).exists():  # not a concurrent writer of the same revision: a real failure
                raise
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rev


def discard_dir(path: Path) -> None:
    """Delete a directory without ever leaving part of it under its own name: rename it to a hidden sibling
    (`.NAME.discarded-XXXXXXXX`), then delete that. A reader, or a publisher asking whether a revision is on disk,
    sees the whole directory or none; a crash mid-delete leaves the hidden sibling, which the next gc removes. A
    directory already set aside is deleted where it is; a missing one is nothing to do."""
    path = Path(path)
    if DISCARDED not in path.name:
        aside = path.with_name(f".{path.name}{DISCARDED}{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        path = aside
    shutil.rmtree(path, ignore_errors=True)


def file_record(meta: RevisionMeta) -> dict[str, Any]:
    """What a revision directory's mint_revision.json carries of an entry (nbytes and stored live in the index)."""
    return {k: v for k, v in meta.to_dict().items() if k not in ("nbytes", "stored")}


def read_record(path: Path) -> dict[str, Any] | None:
    """A revision directory's mint_revision.json, or None when it is missing or does not parse."""
    try:
        return json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def same_json(a: Any, b: Any) -> bool:
    """Whether two values are equal as JSON stores them (a tuple as a list, keys in any order)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def recorded_revision(path: Path, rid: str) -> RevisionMeta | None:
    """The metadata of `path` when it is a whole directory of revision `rid` as a catalog writes one: every file
    there and parsing, the tensors hashing to `rid`, mint_revision.json naming `rid` with exactly an entry's fields,
    and the adapter config beside it its LoRA config. None otherwise: a directory counts as written only then, and
    one whose files a crash left half deleted does not."""
    try:
        tensors, config, record = read_revision_files(path)
        check_revision_id(path, tensors, rid)
        meta = RevisionMeta.from_dict(record)
    except (MintError, TypeError):  # TypeError: a field missing
        return None
    if meta.id != rid or not same_json(record, file_record(meta)) or not same_json(config, meta.lora_config):
        return None
    return meta


def read_revision_dir(
    path: Path, expect_id: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(tensors, adapter_config, meta) of a revision directory, after checking the tensors hash to its id.

    Raises a one-line MintError for a missing, partial or corrupt file, or a hash that differs from `expect_id`
    (default: the id recorded in mint_revision.json).
    """
    path = Path(path)
    tensors, adapter_config, meta = read_revision_files(path)
    check_revision_id(path, tensors, expect_id or meta.get("id"))
    return tensors, adapter_config, meta


def read_revision_files(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(tensors, adapter_config, meta) of a revision directory, parsed but NOT hash-checked: for a reader that must
    re-lay the tensors out first (a per-expert directory, `mint.hub.export.read_adapter_dir`) and then calls
    `check_revision_id`. Raises a one-line MintError for a missing, partial or unparsable file."""
    path = Path(path)
    for name in (ADAPTER_FILE, CONFIG_FILE, META_FILE):
        if not (path / name).is_file():
            raise MintError(f"{path}: not a complete revision ({name} is missing)")
    try:
        adapter_config = json.loads((path / CONFIG_FILE).read_text())
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as err:
        raise MintError(f"{path}: unreadable revision metadata ({_one_line(err)})") from None
    if not isinstance(adapter_config, dict) or not isinstance(meta, dict):
        raise MintError(f"{path}: unreadable revision metadata (not a JSON object)")
    tensors = _parse_adapter(path / ADAPTER_FILE, lambda: st_load_file(str(path / ADAPTER_FILE)))
    return tensors, adapter_config, meta


def read_adapter_bytes(path: Path, expect_id: str) -> bytes:
    """The raw bytes of a revision directory's tensors file, after checking that they parse and hash to `expect_id`.

    An export writes exactly these bytes, so its copy is the one that was checked (a second read could differ).
    """
    path = Path(path)
    try:
        data = (path / ADAPTER_FILE).read_bytes()
    except OSError as err:
        raise MintError(f"{path}: not a complete revision ({ADAPTER_FILE}: {err.strerror})") from None
    check_revision_id(path, _parse_adapter(path / ADAPTER_FILE, lambda: st_load(data)), expect_id)
    return data


def _parse_adapter(file: Path, load) -> dict[str, torch.Tensor]:
    try:
        return load()
    except Exception as err:  # safetensors raises its own error type for a truncated or garbled file
        raise MintError(f"{file}: unreadable safetensors, partial or corrupt write ({_one_line(err)})") from None


def check_revision_id(path: Path, tensors: dict[str, torch.Tensor], expected: str | None) -> None:
    """Refuse (one-line MintError) tensors that do not hash to revision `expected`."""
    actual = revision_id(tensors)
    if actual != expected:
        raise MintError(
            f"{path}: tensors hash to {actual[:12]}, not revision {str(expected)[:12]}; corrupt, refusing to load"
        )


# ---- base fingerprint -------------------------------------------------------------------------------------------


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start offset, header) of a safetensors file, read without loading any tensor."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def _local_model_dir(spec: str) -> Path | None:
    if os.path.isdir(spec):
        return Path(spec)
    try:  # a hub id that is already in the local cache; never downloads
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:
        return None


_FINGERPRINTS: dict[tuple[str, float], str] = {}


def base_fingerprint(spec: str) -> str:
    """sha256 of the base's config.json (minus volatile keys) plus checksums of selected tensors.

    The tensors are FINGERPRINT_TENSORS names evenly spaced over the sorted names of all *.safetensors files; each
    contributes its name, dtype, shape and the sha256 of its first FINGERPRINT_BYTES bytes. A base that is not a local
    directory or cached hub snapshot gets `unresolved:<sha256 of the spec>`, which never matches a real fingerprint.
    """
    directory = _local_model_dir(spec)
    if directory is None or not (directory / "config.json").is_file():
        return "unresolved:" + hashlib.sha256(spec.encode()).hexdigest()
    key = (str(directory.resolve()), (directory / "config.json").stat().st_mtime)
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    config = json.loads((directory / "config.json").read_text())
    for k in _VOLATILE_CONFIG_KEYS:
        config.pop(k, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    entries: dict[str, tuple[Path, int, dict]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        start, header = _safetensors_header(file)
        for name, info in header.items():
            entries[name] = (file, start, info)
    names = sorted(entries)
    if names:
        n = min(FINGERPRINT_TENSORS, len(names))
        picked = sorted({names[round(i * (len(names) - 1) / max(n - 1, 1))] for i in range(n)})
        for name in picked:
            file, start, info = entries[name]
            begin, end = info["data_offsets"]
            with open(file, "rb") as f:
                f.seek(start + begin)
                digest = hashlib.sha256(f.read(min(end - begin, FINGERPRINT_BYTES))).hexdigest()
            h.update(f"{name}|{info['dtype']}|{info['shape']}|{digest}|".encode())
    _FINGERPRINTS[key] = h.hexdigest()
    return _FINGERPRINTS[key]
