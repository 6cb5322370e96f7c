"""The Python tool's sandbox (mint.envs.sandbox): one namespace per episode, every hostile call a tool error, nothing
left behind.

Each test makes its sandboxes under its own tmp_path, which is in every worker's command line and so in every fork's:
`Episodes.leftovers` finds what a test left by it (wherever the process was reparented), and a sandbox that forgot to
kill or remove something fails the test that made it, even while other sandboxes run on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from mint.envs.sandbox import WORKER, PythonSandbox, SandboxError, SandboxLimits, ToolResult
from mint.errors import ConfigError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

# Calls that must finish get a wall limit with slack for a loaded 2-core machine; calls that must time out a short one.
QUICK = SandboxLimits(cpu_s=1, wall_s=20.0)
SHORT = SandboxLimits(cpu_s=1, wall_s=0.3)

SLEEP = "import time\ntime.sleep(100)"
LOOP = "while True:\n    pass"
ALLOCATE = "bytearray(10 * 2**30)"
PRINT = "print('x' * (100 * 2**20))"
EXIT = "import os\nos._exit(3)"
KILL = "import os\nos.kill(os.getpid(), 9)"
# A grandchild that leaves the worker's process group (setsid) and whose parent exits: without the subreaper it
# would be reparented to init, out of reach of a process-group kill. The call returns once it runs.
DOUBLE_FORK = """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, b"x")
        time.sleep(1000)
    os._exit(0)
os.read(r, 1)
os.wait()
"""
# Two children that sleep forever, and the escaping grandchild.
FORK = (
    """
import os, time
for _ in range(2):
    if os.fork() == 0:
        time.sleep(1000)
"""
    + DOUBLE_FORK
    + "'done'"
)

# A thread that forks (and leaves the process group) after its call has ended.
LATE_FORK = """
import os, threading, time
def fork_later():
    time.sleep(0.2)
    if os.fork() == 0:
        os.setsid()
        time.sleep(1000)
threading.Thread(target=fork_later).start()
"""


class Episodes:
    """Makes sandboxes under `root` and checks that they left nothing: no process and no file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.before = {p.pid for p in psutil.Process().children(recursive=True)}

    def sandbox(self, limits: SandboxLimits = QUICK, **kwargs) -> PythonSandbox:
        return PythonSandbox(limits, temp_root=self.root, **kwargs)

    def leftovers(self) -> dict[int, str]:
        """Live processes of this test's sandboxes, by pid: any process whose command line names the worker and this
        root (a worker or a fork of one, wherever it was reparented), and any new descendant of this process."""
        found = {}
        for proc in psutil.process_iter(["cmdline", "status"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if WORKER.name in cmdline and str(self.root) in cmdline:
                found[proc.pid] = f"{proc.info['status']}: {cmdline[:150]}"
        for proc in psutil.Process().children(recursive=True):
            if proc.pid not in self.before and proc.pid not in found:
                with contextlib.suppress(psutil.NoSuchProcess):
                    found[proc.pid] = f"{proc.status()}, a descendant of the test: {proc.cmdline()}"
        return found

    def assert_clean(self) -> None:
        assert self.leftovers() == {}
        assert list(self.root.iterdir()) == []


@pytest.fixture
def episodes(tmp_path) -> Episodes:
    root = tmp_path / "episodes"
    root.mkdir()
    return Episodes(root)


def test_state_persists_within_an_episode_and_not_across_episodes(episodes):
    with episodes.sandbox() as one, episodes.sandbox() as two:
        assert one.run_sync("x = 41\ndef inc(v):\n    return v + 1").ok
        assert one.run_sync("inc(x)") == ToolResult(True, "42")
        assert one.run_sync("_ * 2").output == "84"  # the last value is `_`, as in the interactive interpreter
        other = two.run_sync("x")
        assert other.error == "exception: NameError: name 'x' is not defined"
    episodes.assert_clean()


def test_output_is_what_was_printed_then_the_final_value_or_the_traceback(episodes):
    with episodes.sandbox() as sandbox:
        printed = sandbox.run_sync("import sys\nprint('a')\nprint('b', file=sys.stderr)\n[1, 'two']")
        assert printed == ToolResult(True, "a\nb\n[1, 'two']")
        assert sandbox.run_sync("y = 1") == ToolResult(True, "")
        failed = sandbox.run_sync("print('before')\n1 / 0")
        assert not failed.ok and failed.error == "exception: ZeroDivisionError: division by zero"
        assert failed.output.startswith("before\nTraceback")
        assert '"<call 3>", line 2' in failed.output and failed.output.endswith("ZeroDivisionError: division by zero")
        assert "_sandbox_worker" not in failed.output  # the worker's own frames are not the code's
        syntax = sandbox.run_sync("def (")
        assert syntax.error.startswith("exception: SyntaxError: ")
        assert sandbox.run_sync("y + 1").output == "2"  # failures keep the namespace
    episodes.assert_clean()


@pytest.mark.parametrize(
    "code, limits, error, kept",
    [
        pytest.param(SLEEP, SHORT, "timeout after 0.3 s", False, id="sleep"),
        pytest.param(LOOP, SHORT, "timeout after 0.3 s", False, id="loop-wall"),
        pytest.param(LOOP, QUICK, "cpu limit (1 s) exceeded", True, id="loop-cpu"),
        pytest.param(ALLOCATE, QUICK, "memory limit (1 GiB) exceeded", True, id="allocate-10-GiB"),
        pytest.param(FORK, QUICK, "3 process(es) still running at the end of the call were killed", True, id="fork"),
        pytest.param(PRINT, QUICK, None, True, id="print-100-MB"),
        pytest.param(EXIT, QUICK, "process exited with status 3", False, id="os._exit"),
        pytest.param(KILL, QUICK, "process crashed (signal 9)", False, id="sigkill-self"),
    ],
)
def test_a_hostile_call_is_a_tool_error_and_the_next_call_works(episodes, code, limits, error, kept):
    """Each hostile call comes back as a value; a crash or a timeout costs the namespace and says so, the others keep
    it; no process of the call survives it."""
    with episodes.sandbox(limits) as sandbox:
        assert sandbox.run_sync("x = 1").ok
        result = sandbox.run_sync(code)
        if error is None:
            assert result.ok and result.truncated and result.error is None
        else:
            assert not result.ok and result.error.startswith(error), result
        assert result.ok == (result.error is None)
        assert (result.error or "").endswith("variables are lost, files are kept") == (not kept)
        assert len(result.output.encode()) <= sandbox.limits.output_bytes + 100
        if not kept:
            assert sandbox.run_sync("x").error == "exception: NameError: name 'x' is not defined"
        again = sandbox.run_sync("x" if kept else "1 + 1")
        assert again.ok and again.output == ("1" if kept else "2"), again
        running = list(episodes.leftovers().values())
        assert len(running) == 1 and WORKER.name in running[0], running  # the next call's worker, nothing else
    episodes.assert_clean()


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "audit-hook"])
def test_no_network_reaches_a_port_the_test_listens_on(episodes, namespaces):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the port is reachable from here
        server.accept()[0].close()
        with episodes.sandbox(namespaces=namespaces) as sandbox:
            expected = ("namespace", "audit_hook") if namespaces else ("audit_hook",)
            assert sandbox.network_isolation in expected
            result = sandbox.run_sync(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)")
            assert not result.ok and result.error.startswith("exception: "), result
            if sandbox.network_isolation == "audit_hook":
                assert result.error.startswith("exception: PermissionError: socket.")  # getaddrinfo, then connect
                assert sandbox.run_sync("import subprocess\nsubprocess.run(['true'])").error.startswith(
                    "exception: PermissionError: subprocess.Popen is disabled"
                )
            else:
                assert "Network is unreachable" in result.error
            assert sandbox.run_sync("1 + 1").output == "2"
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()
    episodes.assert_clean()


def test_a_worker_that_dies_leaves_no_escaped_grandchild(episodes):
    """A `setsid` grandchild whose worker then exits is reparented to init, out of the process group and the
    subreaper's reach: it is found by the marker in its environment, right after the call."""
    with episodes.sandbox() as sandbox:
        result = sandbox.run_sync(DOUBLE_FORK + "os._exit(3)")
        assert result.error.startswith("process exited with status 3")
        assert episodes.leftovers() == {}  # the dead worker is not restarted until the next call
        assert sandbox.run_sync("1 + 1").output == "2"
    episodes.assert_clean()


def test_output_is_capped_in_the_worker_and_in_the_parent(episodes):
    """100 MB written to fd 1 directly passes the worker's print cap: this side keeps 64 KiB of it, never more."""
    with episodes.sandbox() as sandbox:
        tracemalloc.start()
        try:
            result = sandbox.run_sync("import os\nos.write(1, b'y' * (100 * 2**20))\n7")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert result.ok and result.truncated
        assert result.output == "y" * (64 << 10) + "\n[output truncated at 64 KiB]\n7"
        assert peak < 4 << 20, peak
        big = sandbox.run_sync("list(range(10**6))")
        assert big.truncated and big.output.endswith("[repr truncated]")
        assert len(big.output) < (64 << 10) + 100
    episodes.assert_clean()


def test_files_live_in_the_episode_directory_until_close(episodes, monkeypatch):
    monkeypatch.setenv("MINT_SANDBOX_TEST_SECRET", "hunter2")
    sandbox = episodes.sandbox()
    where = sandbox.run_sync("import os, tempfile\nos.getcwd(), tempfile.gettempdir()")
    assert where.output == repr((str(sandbox.directory), str(sandbox.directory / "tmp")))
    assert sandbox.run_sync("import os\n'MINT_SANDBOX_TEST_SECRET' in os.environ").output == "False"  # not inherited
    assert sandbox.run_sync("open('notes.txt', 'w').write('kept')\nimport tempfile\ntempfile.mkstemp()[0] > 0").ok
    assert sandbox.run_sync(KILL).error.startswith("process crashed (signal 9)")
    assert sandbox.run_sync("open('notes.txt').read()").output == "'kept'"  # a fresh worker, the same directory
    assert sandbox.run_sync("import os\nos.mkdir('locked')\nos.chmod('locked', 0)").ok
    sandbox.close()
    assert not sandbox.directory.exists()
    sandbox.close()  # twice is fine
    with pytest.raises(SandboxError, match="closed"):
        sandbox.run_sync("1")
    episodes.assert_clean()


def test_closing_during_a_call_ends_the_call(episodes):
    sandbox = episodes.sandbox()
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(sandbox.run_sync, "open('started', 'w').close()\n" + SLEEP)
        deadline = time.monotonic() + 20
        while not (sandbox.directory / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        sandbox.close()
        result = call.result(timeout=10)
    assert result.error == "the sandbox was closed during the call"
    episodes.assert_clean()


def test_async_episodes_run_concurrently(episodes):
    async def episode(n: int) -> list[str]:
        async with episodes.sandbox() as sandbox:
            await sandbox.run(f"n = {n}")
            return [(await sandbox.run("import time\ntime.sleep(0.5)\nn")).output, (await sandbox.run("n * 2")).output]

    async def main():
        started = time.monotonic()
        results = await asyncio.gather(*(episode(n) for n in range(4)))
        return results, time.monotonic() - started

    results, _ = asyncio.run(main())
    assert results == [[str(n), str(n * 2)] for n in range(4)]
    episodes.assert_clean()


def test_close_kills_what_a_thread_forked_between_calls(episodes):
    """A thread the code started keeps running after its call; what it forks then is killed by close (or at the end
    of the next call)."""
    sandbox = episodes.sandbox()
    assert sandbox.run_sync(LATE_FORK).ok
    deadline = time.monotonic() + 20
    while len(episodes.leftovers()) < 2 and time.monotonic() < deadline:  # the worker and the fork
        time.sleep(0.05)
    assert len(episodes.leftovers()) == 2, episodes.leftovers()
    sandbox.close()
    episodes.assert_clean()


def test_a_killed_parent_leaves_nothing_behind(episodes):
    """The worker notices its parent's death (its request pipe closes), kills what the code left and removes the
    episode's directory: a rollout process killed by SIGKILL does not leak its episodes."""
    script = (
        "import sys\nfrom mint.envs.sandbox import PythonSandbox\n"
        f"sandbox = PythonSandbox(temp_root={str(episodes.root)!r})\n"
        f"print(sandbox.run_sync({LATE_FORK!r}).ok, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "True"
        deadline = time.monotonic() + 20
        while len(episodes.leftovers()) < 2 and time.monotonic() < deadline:  # the worker and the fork
            time.sleep(0.05)
        assert len(episodes.leftovers()) == 2 and len(list(episodes.root.iterdir())) == 1, episodes.leftovers()
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while (episodes.leftovers() or list(episodes.root.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    episodes.assert_clean()


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ConfigError, match="wall_s"):
        SandboxLimits(wall_s=0)


# The hostile tools of the hygiene test, each with the limits it runs under and what its call must answer. 100 MB
# is printed in 1 MiB lines there: the same bytes as one 100 MB string, without 8 threads' worth of 100 MB buffers.
HOSTILE = [
    ("sleep", SLEEP, SandboxLimits(cpu_s=1, wall_s=0.2), lambda r: r.error.startswith("timeout after 0.2 s")),
    ("loop", LOOP, SandboxLimits(cpu_s=1, wall_s=0.2), lambda r: r.error.startswith(("timeout", "cpu limit"))),
    ("allocate", ALLOCATE, QUICK, lambda r: r.error == "memory limit (1 GiB) exceeded"),
    ("fork", FORK, QUICK, lambda r: r.error.startswith("3 process(es) still running")),
    # the same tree, still running when the wall clock kills the worker
    ("fork-and-hang", FORK + "\n" + SLEEP, SandboxLimits(cpu_s=1, wall_s=0.5), lambda r: r.error.startswith("timeout")),
    ("print", "for _ in range(100):\n    print('x' * 2**20)", QUICK, lambda r: r.ok and r.truncated),
]


@pytest.mark.slow
def test_a_thousand_hostile_episodes_leave_no_process_and_no_file(episodes):
    """1,000 episodes cycle through the hostile tools, 8 at a time: each call is a tool error (or truncated output),
    a worker that survived its call still answers, and afterwards no process of theirs runs and their temporary
    root is empty."""

    def episode(n: int) -> tuple[str, ToolResult, ToolResult | None]:
        name, code, limits, _ = HOSTILE[n % len(HOSTILE)]
        with episodes.sandbox(limits) as sandbox:
            result = sandbox.run_sync(code)
            after = sandbox.run_sync("1 + 1") if name in ("allocate", "fork", "print") else None
        return name, result, after

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(episode, range(1000)))
    elapsed = time.monotonic() - started
    checks = {name: check for name, _, _, check in HOSTILE}
    wrong = [(name, result) for name, result, _ in results if not checks[name](result)]
    assert not wrong, wrong[:5]
    assert all(after.output == "2" for _, _, after in results if after is not None)
    episodes.assert_clean()
    print(f"1,000 hostile episodes in {elapsed:.1f} s")
