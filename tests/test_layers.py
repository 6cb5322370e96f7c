"""Imports point downward only: mint -> longstraw -> longstraw.kernels (ARCHITECTURE.md)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package folder -> top-level modules it must never import
FORBIDDEN = {
    "longstraw": {"mint", "ray"},
    "kernels": {"mint", "longstraw", "ray", "transformers", "peft", "deepspeed"},
}
ALLOWED_IN_KERNELS = "longstraw.kernels"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_imports_point_downward():
    bad = []
    for folder, forbidden in FORBIDDEN.items():
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path):
                top = name.split(".")[0]
                if top in forbidden and not (folder == "kernels" and name.startswith(ALLOWED_IN_KERNELS)):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_triton_only_inside_kernels():
    bad = [
        str(p.relative_to(ROOT))
        for folder in ("mint", "longstraw")
        for p in (ROOT / folder).rglob("*.py")
        if any(n.split(".")[0] == "triton" for n in _imports(p))
    ]
    assert not bad, bad


def test_no_top_level_kernels_package(tmp_path):
    """transformers imports Hugging Face's `kernels` by that name: ours must only install as longstraw.kernels.

    Checked in a fresh interpreter started outside the repo, since a repo-root cwd on sys.path would shadow it.
    """
    import longstraw.kernels

    assert Path(longstraw.kernels.__file__).parent == ROOT / "kernels"
    probe = "import importlib.util as u, longstraw.kernels as k; s = u.find_spec('kernels'); print(s and s.origin)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert str(ROOT / "kernels") not in out.stdout, out.stdout
