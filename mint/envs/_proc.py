"""The sandbox's process trees on Linux, read from /proc: list a worker's descendants, kill them, find the processes
an episode's tree left behind, and remove an episode's directory whatever the code did to it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

# The variable every process of a worker's tree inherits: it names the episode's directory, so the processes that
# left the tree when their worker died (reparented to init) can still be found by it.
MARKER = "MINT_SANDBOX"
# How long the parent keeps killing a tree whose processes keep forking, before it gives up on that call.
KILL_S = 2.0


def remove_tree(path: Path) -> None:
    """Remove the episode's directory even where the code took its own permissions away (chmod 0 on a folder)."""

    def retry(function, name, _exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(name), 0o700)
            os.chmod(name, 0o700)
            function(name)

    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=retry)


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) from /proc. psutil's `children(recursive=True)` builds a Process object per
    process on the machine (13 to 30 ms a call on the test machine with about 100 processes); this reads the same
    /proc/N/stat files in about a quarter of that, and it runs after every call."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # exited meanwhile
            state, ppid = stat[stat.rfind(b")") + 2 :].split(b" ", 2)[:2]
            table[int(name)] = (int(ppid), state.decode())
    return table


def descendants(root: int) -> list[int]:
    """The live (not zombie) descendants of `root`."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if table[pid][1] != "Z":
            found.append(pid)
        todo += children.get(pid, ())
    return found


def kill_descendants(root: int) -> None:
    """SIGKILL the descendants of `root` until none is alive: a process forked between a listing and its kills is
    found by the next listing (an orphan is reparented to `root`, the subreaper). Gives up after KILL_S."""
    deadline = time.monotonic() + KILL_S
    while (live := descendants(root)) and time.monotonic() < deadline:
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def kill_marked(directory: Path) -> None:
    """SIGKILL every process whose environment names this episode's directory: what a worker that died on its own
    left behind (a `setsid` grandchild escapes its process group and, with its subreaper gone, went to init).
    A program the code started with a scrubbed environment is not found: that is the remaining gap."""
    needle = f"{MARKER}={directory}".encode()
    for _ in range(3):  # a marked process may fork while this scans; three passes outrun a casual fork
        found = False
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid():
                try:
                    with open(f"/proc/{name}/environ", "rb") as f:
                        marked = needle in f.read().split(b"\0")
                except OSError:
                    continue
                if marked:
                    found = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(name), signal.SIGKILL)
        if not found:
            return
