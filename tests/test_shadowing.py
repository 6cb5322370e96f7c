"""No folder at the repo root shadows an installed distribution, under the conditions users run Mint in.

Ray puts the driver's working directory on every worker's sys.path, and so do `python -m` from the root and
`ray job submit --working-dir .`. When kernels/ was a regular package (an __init__.py at its top), a Ray worker of a
run started from the repo root imported it in place of Hugging Face's `kernels`, which transformers >= 5.25 imports
from transformers.modeling_utils, and `make run` died before its first step with
"cannot import name 'CUDAProperties' from 'kernels'". The checks below run from the repo root, as users do.
"""

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"mint", "longstraw", "mint_kernels", "tests", "bench", "recipes", "launch", "docs"}


def _installed_top_level_names() -> dict[str, list[str]]:
    """{import name: [distributions]} of every installed distribution but Mint's own."""
    names = md.packages_distributions()
    return {name: dists for name, dists in names.items() if not set(dists) <= {"mint-rl", "mint-kernels"}}


def test_no_root_folder_is_a_regular_package_under_an_installed_name():
    """A regular package (a folder with __init__.py) or module at the root wins over site-packages for any process
    whose sys.path holds the root; a folder without __init__.py is only a namespace portion, which an installed
    regular package always beats."""
    installed = _installed_top_level_names()
    clashes = [
        f"{entry.name}/ ({', '.join(installed[entry.name])})"
        for entry in ROOT.iterdir()
        if entry.is_dir() and (entry / "__init__.py").is_file() and entry.name in installed
    ]
    clashes += [
        f"{entry.name} ({', '.join(installed[entry.stem])})" for entry in ROOT.glob("*.py") if entry.stem in installed
    ]
    assert not clashes, f"repo-root names that shadow installed distributions: {clashes}"


def test_root_folder_names_resolve_to_site_packages_from_the_root():
    """Every root folder name that an installed distribution also provides imports as the installed one when the
    interpreter runs from the repo root (cwd first on sys.path, as with `python -m` and Ray workers)."""
    installed = _installed_top_level_names()
    shared = sorted(e.name for e in ROOT.iterdir() if e.is_dir() and e.name in installed and e.name not in OURS)
    assert "kernels" in shared, "Hugging Face's kernels is a transformers dependency: the lock installs it"
    probe = (
        "import importlib, sys; "
        f"mods = [importlib.import_module(n) for n in {shared!r}]; "
        "print('\\n'.join(str(getattr(m, '__file__', None) or list(m.__path__)) for m in mods))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for name, where in zip(shared, out.stdout.splitlines(), strict=True):
        assert not where.startswith(str(ROOT / name)), f"`import {name}` from the repo root found {where}"


@pytest.mark.slow
def test_a_ray_worker_started_from_the_repo_root_imports_transformers_modeling_utils():
    """The failure users met: a Ray driver started from the repo root, a task importing transformers.modeling_utils
    (which imports Hugging Face's `kernels`); `kernels` in the worker must be the installed distribution."""
    driver = """
import ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote
def probe():
    import os, sys
    import transformers.modeling_utils  # noqa: F401 (imports `kernels` on transformers >= 5.25)
    import kernels, mint_kernels
    return os.getcwd(), sys.path[:3], kernels.__file__, mint_kernels.__file__

print(repr(ray.get(probe.remote())))
ray.shutdown()
"""
    out = subprocess.run(
        [sys.executable, "-c", driver], cwd=ROOT, capture_output=True, text=True, timeout=300, env=_ray_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cwd, path_head, hf_kernels, ours = eval(out.stdout.strip().splitlines()[-1])
    assert hf_kernels is not None and not hf_kernels.startswith(str(ROOT / "kernels")), hf_kernels
    assert Path(ours).parent == ROOT / "kernels" / "mint_kernels", ours
    installed = Path(md.distribution("kernels").locate_file("kernels/__init__.py")).resolve()
    assert Path(hf_kernels).resolve() == installed, (hf_kernels, installed)
    # The condition is real: the worker ran with the repo root as its working directory and on its path.
    assert Path(cwd) == ROOT or str(ROOT) in map(str, path_head), (cwd, path_head)


def _ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # a fresh local cluster of its own, never the suite's shared one
    return env
