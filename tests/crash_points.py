"""Kill a real process at every filesystem step of an operation, one crash point per process.

`killed_at_every_step(body, state, out)` runs `body` (Python source, run with `root` bound to a fresh copy of the
directory `state`) in one new interpreter that forks a child per crash point. Child n SIGKILLs itself right before
its first step (n = 0) or right after its n-th (n >= 1); a step is a rename, replace, unlink or rmdir, the calls that
change which files a directory holds (shutil.rmtree deletes through unlink and rmdir, pathlib through the same
calls). The first child that finishes without reaching its point ends the sweep, so every moment between two steps
is covered whatever the operation's code does between them. The interpreter runs `imports` once before it forks, in
the namespace each body then starts from, so a crash point costs a fork, not a torch import. Returns the copies the
killed children left, in order.

Run as a script, this file is that interpreter: `python crash_points.py IMPORTS BODY STATE OUT`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

STEPS = ("rename", "replace", "unlink", "remove", "rmdir")
MAX_POINTS = 200  # an operation with more steps than this is not one these tests should sweep


def killed_at_every_step(body: str, state: Path, out: Path, imports: str = "", timeout: float = 300) -> list[Path]:
    root = Path(__file__).resolve().parents[1]
    path = [str(root), str(root / "kernels"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run(
        [sys.executable, __file__, imports, body, str(state), str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [Path(p) for p in json.loads(proc.stdout.strip().splitlines()[-1])]


def _arm(point: int) -> None:
    """Make this process SIGKILL itself before its first step (point 0) or after its point-th step."""
    done = 0

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn):
        def step(*args, **kwargs):
            nonlocal done
            if point == 0:
                die()
            result = fn(*args, **kwargs)
            done += 1
            if done == point:
                die()
            return result

        return step

    for name in STEPS:
        setattr(os, name, wrap(getattr(os, name)))


def _sweep(imports: str, body: str, state: Path, out: Path) -> list[str]:
    import shutil
    import traceback

    scope: dict = {}
    exec(imports, scope)
    killed = []
    for point in range(MAX_POINTS):
        copy = out / f"point_{point:03d}"
        shutil.copytree(state, copy)
        pid = os.fork()
        if pid == 0:  # the child: one crash point
            code = 0
            try:
                _arm(point)
                exec(body, {**scope, "root": copy})
            except BaseException:
                (out / "error.txt").write_text(f"crash point {point}:\n{traceback.format_exc()}")
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            killed.append(str(copy))
            continue
        if os.WEXITSTATUS(status) != 0:
            sys.exit((out / "error.txt").read_text())
        shutil.rmtree(copy)
        return killed
    sys.exit(f"more than {MAX_POINTS} steps")


if __name__ == "__main__":
    _imports, _body, _state, _out = sys.argv[1:5]
    print(json.dumps(_sweep(_imports, _body, Path(_state), Path(_out))))
