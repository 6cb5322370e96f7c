"""The shipped tiny bases: the `tiny:<family>` builds committed under `mint/models/tiny_bases/<family>-<recipe key>/`.

Why ship rather than build on first use: a build's bytes follow the CPU's float kernels. The same recipe built under
`ATEN_CPU_CAPABILITY=default`, `=avx2` and `=avx512` gave three different model.safetensors for every family (SIMD
width changes the order of the sums, and 600-1000 training steps amplify the last bits), and a different base
starts RL from a different skill: on an AVX2-only machine the expert-parallel smoke run started at reward 0.49 and
missed its learning threshold (gain 0.474 against >= 0.5). Shipping the bytes makes every machine start from the same
base. docs/decisions.md has the measured digests.

Each shipped folder holds what `build_tiny` saved plus, in its `mint_tiny.json`, `sha256` (file name -> digest of
every other file in the folder) and `built_with` (torch, transformers, CPU capability of the build). `ensure_tiny`
copies the folder matching the current recipe key into the cache and checks every digest; it builds only when no
shipped folder matches the key (a recipe change nobody shipped yet).

Regenerate deliberately, with `make tiny-bases` (`python -m mint.models.tiny_rebuild`), after any change that moves a
build's bytes: TinyRecipe defaults, BUILD_VERSION, `tiny_config`, the tokenizer corpus, the pretraining loop, or a
transformers upgrade that changes the saved files. The new bytes are this machine's: rerun the learning tests (the
smoke recipe's reward gain) before committing them, because the starting skill moves with the bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile

from mint.errors import MintError

log = logging.getLogger(__name__)

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_bases")
MANIFEST = "mint_tiny.json"  # the same name as tiny.MANIFEST (not imported: tiny imports this module)


class ShippedBaseError(MintError):
    """A shipped tiny base's files do not match the digests in its manifest."""


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(directory: str) -> dict:
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def shipped_path(name: str, root: str | None = None) -> str | None:
    """The shipped folder `<root>/<name>` (name = `<family>-<recipe key>`), or None when none is shipped for it."""
    path = os.path.join(root or SHIPPED_DIR, name)
    return path if os.path.isfile(os.path.join(path, MANIFEST)) else None


def matches(directory: str, digests: dict[str, str]) -> bool:
    """Whether every file named in `digests` exists in `directory` with that sha256 (other files are ignored)."""
    return all(
        os.path.isfile(p := os.path.join(directory, name)) and file_sha256(p) == digest
        for name, digest in digests.items()
    )


def copy_verified(source: str, directory: str) -> None:
    """Copy the shipped folder `source` into the existing empty `directory`, then check every file's digest.

    The manifest is copied last, so a partial copy is never a complete cache entry.
    """
    digests = read_manifest(source)["sha256"]
    for name in sorted(digests):
        shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    if not matches(directory, digests):
        bad = [n for n in sorted(digests) if file_sha256(os.path.join(directory, n)) != digests[n]]
        raise ShippedBaseError(f"shipped tiny base {source}: {', '.join(bad)} do not match the manifest's sha256")
    shutil.copyfile(os.path.join(source, MANIFEST), os.path.join(directory, MANIFEST))


def write_json(path: str, data: dict) -> None:
    """Write `path` atomically: a temp file beside it, renamed over it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def replace_dir(tmp: str, target: str) -> None:
    """Move the finished folder `tmp` to `target`, replacing an old one: rename aside, rename in, then remove."""
    old = None
    if os.path.exists(target):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target))
        os.rename(target, os.path.join(old, "old"))
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old)
