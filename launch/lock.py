"""Write and check the lock files: the exact versions a virtualenv was resolved to.

    python launch/lock.py write LOCK [--from-venv]     # freeze this interpreter's environment into LOCK
    python launch/lock.py check LOCK                   # every installed distribution at LOCK's version, or exit 1
    python launch/lock.py diff LOCK                    # what this environment resolved differently (deps-latest)

Run it with the virtualenv's own python. The lock lists every installed distribution as `name==version`, sorted,
except the ones named in UNLOCKED: torch, whose build the setup commands pick (a CPU wheel here, a cluster's own
CUDA build there), and Mint's two editable packages. `check` is what keeps a fresh machine on the versions the suite
passed with: a dependency added to pyproject.toml but not to the lock is installed at whatever the registry serves
that day, and `check` names it and stops the setup. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import sys
import tempfile
from pathlib import Path

# torch's build is chosen by the setup (TORCH in the Makefile); mint-rl and mint-kernels are this repo, editable;
# setuptools and wheel come with the interpreter's venv (pip is locked: `make setup` installs the pinned one first).
UNLOCKED = {"torch", "mint-rl", "mint-kernels", "setuptools", "wheel"}
HEADER = (
    "# The exact versions the test suite passed with (`make lock` writes this file; do not edit by hand).\n"
    "# torch is pinned by the Makefile's TORCH, apart from this file: a CPU build here, a CUDA build on a cluster.\n"
)


def canonical(name: str) -> str:
    """PEP 503 normal form: `Foo_Bar.baz` and `foo-bar-baz` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """{canonical name: version} of every distribution this interpreter sees, less UNLOCKED."""
    found: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) not in UNLOCKED:
            found[canonical(name)] = dist.version
    return found


def read_lock(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise SystemExit(f"lock.py: {path}:{n}: expected name==version, got {raw!r}")
        pins[canonical(name.strip())] = version.strip()
    return pins


def write(path: Path) -> None:
    body = "".join(f"{name}=={version}\n" for name, version in sorted(installed().items()))
    # Atomic: a reader (or a Ctrl-C) never sees half a lock.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(HEADER + body)
    os.replace(tmp, path)
    print(f"lock.py: wrote {len(body.splitlines())} pins to {path}")


def drift(path: Path) -> list[str]:
    """One line per installed distribution that the lock does not pin at its installed version."""
    pins = read_lock(path)
    lines = []
    for name, version in sorted(installed().items()):
        if name not in pins:
            lines.append(f"{name}=={version} is installed but not in {path}")
        elif pins[name] != version:
            lines.append(f"{name}=={version} is installed but {path} pins {pins[name]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=["write", "check", "diff"])
    parser.add_argument("lock", type=Path)
    args = parser.parse_args(argv)
    if args.verb == "write":
        write(args.lock)
        return 0
    if not args.lock.is_file():
        print(f"lock.py: no lock at {args.lock}: run `make lock`", file=sys.stderr)
        return 1
    lines = drift(args.lock)
    if args.verb == "diff":
        print("\n".join(lines) if lines else f"lock.py: the newest allowed versions are {args.lock}'s")
        return 0
    if lines:
        print(
            f"lock.py: this environment is not {args.lock} ({len(lines)} differences); run `make lock` after a "
            "dependency change, or `make clean setup` for a stale venv:",
            file=sys.stderr,
        )
        print("\n".join(f"  {line}" for line in lines), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
