"""The locks: the suite runs on exactly requirements.lock's versions, and launch/lock.py names any drift."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
LOCK_PY = ROOT / "launch" / "lock.py"


def _lock(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LOCK_PY), *args, str(path)], capture_output=True, text=True)


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


# `make deps-latest` runs the suite on the newest versions allowed, which differ from the lock by design.
on_the_lock = pytest.mark.skipif(
    os.environ.get("MINT_DEPS_LATEST") == "1", reason="make deps-latest: the newest versions, not the lock's"
)


@on_the_lock
def test_this_environment_is_the_lock():
    """The tests ran on the lock's versions, or they prove nothing about a fresh machine's."""
    out = _lock(LOCK, "check")
    assert out.returncode == 0, out.stderr


def test_every_dependency_in_pyproject_is_pinned():
    """A dependency added to pyproject.toml without `make lock` would float on a fresh machine."""
    pins = _pins(LOCK)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in ("dev", "bench"):
        specs += project["optional-dependencies"][extra]
    own = {"torch", "mint-kernels"}  # torch: the Makefile's TORCH; mint-kernels: kernels/, editable
    names = {re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~; ]", s, maxsplit=1)[0]).lower() for s in specs}
    assert not (names - own - set(pins)), sorted(names - own - set(pins))


@on_the_lock
def test_check_names_a_version_that_drifted_and_a_package_the_lock_lacks(tmp_path):
    pins = _pins(LOCK)
    drifted = tmp_path / "drifted.lock"
    lines = [f"{n}=={v}" for n, v in pins.items() if n not in ("transformers", "numpy")] + ["transformers==0.0.1"]
    drifted.write_text("\n".join(lines) + "\n")
    out = _lock(drifted, "check")
    assert out.returncode == 1
    assert f"transformers=={pins['transformers']} is installed but {drifted} pins 0.0.1" in out.stderr
    assert f"numpy=={pins['numpy']} is installed but not in {drifted}" in out.stderr
    assert "make lock" in out.stderr.splitlines()[0]


def test_a_malformed_lock_line_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad.lock"
    bad.write_text("numpy>=1\n")
    out = _lock(bad, "check")
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0
    assert "bad.lock:1: expected name==version" in out.stderr


@on_the_lock
def test_write_then_check_round_trips(tmp_path):
    fresh = tmp_path / "fresh.lock"
    assert _lock(fresh, "write").returncode == 0
    assert _pins(fresh) == _pins(LOCK)
    assert _lock(fresh, "check").returncode == 0
