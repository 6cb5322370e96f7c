"""Rebuild the shipped tiny bases here: `make tiny-bases` (`python -m mint.models.tiny_rebuild [FAMILY ...]`).

mint.models.tiny_ship says when and why (the bytes are this machine's); this module builds with mint.models.tiny and
writes through tiny_ship, which stays below both so that `tiny` can read the shipped folders without a cycle.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile

import torch
import transformers

from mint.models.specs import TINY_FAMILIES
from mint.models.tiny import TinyRecipe
from mint.models.tiny_ship import MANIFEST, SHIPPED_DIR, file_sha256, read_manifest, replace_dir, write_json


def ship(family: str, root: str | None = None) -> str:
    """Build the default recipe of `family` on this machine into `<root>/<family>-<key>` and record its digests.

    Removes the family's other shipped folders (older recipe keys): only the current key is ever used.
    """
    root = root or SHIPPED_DIR
    recipe = TinyRecipe(family)
    name = f"{family}-{recipe.key()}"
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
    try:
        recipe.build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would travel into the package
        manifest = read_manifest(tmp)
        manifest["sha256"] = {f: file_sha256(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp)) if f != MANIFEST}
        manifest["built_with"] = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        }
        write_json(os.path.join(tmp, MANIFEST), manifest)
        for entry in os.listdir(tmp):  # safetensors and mkstemp write 0o600: readable by all once installed
            os.chmod(os.path.join(tmp, entry), 0o644)
        target = os.path.join(root, name)
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for entry in os.listdir(root):
        if entry.startswith(f"{family}-") and entry != name:
            shutil.rmtree(os.path.join(root, entry))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mint.models.tiny_rebuild",
        description="Rebuild the shipped tiny bases on this machine (30-60 s per family on 1 thread; the Gated "
        "DeltaNet hybrids qwen3_5_moe / qwen3_next / qwen3_5 and the MLA families deepseek_v3 / glm4_moe_lite / "
        "glm_moe_dsa 2-5 min each).",
    )
    parser.add_argument("families", nargs="*", default=list(TINY_FAMILIES), help="families to rebuild (default: all)")
    parser.add_argument("--root", default=SHIPPED_DIR, help="where the shipped folders live")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(TINY_FAMILIES))
    if unknown:
        parser.error(f"unknown tiny families {unknown}; choose from {', '.join(TINY_FAMILIES)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for family in args.families:
        path = ship(family, args.root)
        manifest = read_manifest(path)
        sizes = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))}
        print(
            json.dumps(
                {
                    "path": os.path.relpath(path),
                    "bytes": sum(sizes.values()),
                    "model.safetensors": manifest["sha256"]["model.safetensors"],
                    "built_with": manifest["built_with"],
                    "accuracy_by_task": manifest["accuracy_by_task"],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
