"""The Python tool of agentic episodes: a model's tool call sends Python source, the sandbox runs it and answers with
what it printed and the repr of a final expression, or with a one-line tool error.

- One worker process per episode (mint/envs/_sandbox_worker.py, a fresh `python -I -S`), one namespace for the whole
  episode: call 2 sees the variables of call 1. Its directory is a fresh temporary directory (its cwd, HOME and
  TMPDIR), removed by `close`, whatever happened to the worker.
- The code cannot hurt the episode runner: every failure (an exception, a limit, a crash of the worker) comes back
  as a `ToolResult` value, never as an exception out of `run`. A crash or a timeout costs the namespace: the next
  call starts a fresh worker in the same directory, and the error says so.
- Limits (`SandboxLimits`): CPU seconds and address space enforced by the kernel in the worker, wall clock and output
  size enforced here. No process outlives a call: after each call every descendant of the worker is killed; the
  worker is a child subreaper, so a double fork or a `setsid` grandchild stays its descendant and is found.
- No network: the worker runs in a new user and network namespace, or, where the host refuses namespaces, behind an
  audit hook; `network_isolation` says which.

What this does not isolate (docs/decisions.md): the filesystem (the code runs as this user and can read and write
what this user can; only its own directory is removed), the CPU and memory of the machine as a whole (limits are per
process and per call, not a cgroup), disk space, and a determined escape through raw system calls (a clone with
CLONE_PARENT). It keeps a model's code from reaching the network, from leaving processes or temporary files behind,
and from stalling or crashing the episode runner; it is not a boundary against an adversary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import site
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from mint.envs._proc import MARKER, descendants, kill_descendants, kill_marked, remove_tree
from mint.errors import ConfigError, MintError

WORKER = Path(__file__).with_name("_sandbox_worker.py")
_HEADER = struct.Struct(">I")
# A worker whose reply pipe closed gets this long to show that it exited (a crash) before the parent calls it a
# broken protocol: its files are closed a moment before its exit is reported.
EXIT_WAIT_S = 1.0
# A reply holds a repr and a traceback, each cut to output_bytes of UTF-8 by the worker; JSON escapes a byte to at
# most 6 (\uXXXX), so a reply longer than this is not the worker's.
_REPLY_FACTOR = 16
_LOST = "the next call starts a fresh interpreter: variables are lost, files are kept"


class SandboxError(MintError):
    """The sandbox itself cannot work: the worker does not start, or `run` is called after `close`."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits of one episode's worker.

    cpu_s         10        CPU seconds per call (RLIMIT_CPU, whole seconds; a call gets between cpu_s and cpu_s + 1).
                            Past it the code gets an exception and the namespace is kept. Ten seconds is far beyond a
                            tool call's useful work and keeps a runaway loop from holding a core for the wall limit.
    wall_s        30.0      Wall-clock seconds per call, measured here; past it the worker and all its descendants
                            are killed (the next call starts fresh). It bounds what the CPU limit cannot: sleeping,
                            waiting on a pipe, a C loop that never lets the signal handler run. One slow tool call
                            holds its whole group back (the policy decodes the group's episodes together).
    memory_bytes  1 GiB     Address space of each process (RLIMIT_AS), forks included. Address space, not resident
                            memory: an idle worker maps 14 MB, 100 MB once numpy is imported; the worker keeps BLAS
                            to one thread and glibc to one malloc arena, which would otherwise reserve 64 MB of
                            address space per thread. Eight concurrent episodes then fit in 8 GiB of a rollout host.
    output_bytes  64 KiB    What a call may add to the observation: printed bytes, then a final expression's repr,
                            each cut here (about 16k tokens, more than a tool observation should take). The worker
                            drops what `print` writes past it, this side drops what other writers send past it, so
                            the code cannot make this process hold more.
    start_s       30.0      How long a fresh worker may take to start (20 to 40 ms on the 2-core test machine; the
                            slack is for a loaded rollout host) before the sandbox gives up with SandboxError.
    """

    cpu_s: int = 10
    wall_s: float = 30.0
    memory_bytes: int = 1 << 30
    output_bytes: int = 64 << 10
    start_s: float = 30.0

    def __post_init__(self):
        if not isinstance(self.cpu_s, int) or self.cpu_s < 1:
            raise ConfigError(f"SandboxLimits.cpu_s must be a whole number of seconds >= 1, got {self.cpu_s!r}")
        for name in ("wall_s", "memory_bytes", "output_bytes", "start_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ToolResult:
    """One call's answer. `output`: what the code printed (stdout and stderr, in order), then the repr of a final
    expression, or the traceback's last lines after an exception. `error`: one line when the call failed; None when
    it ran to the end. `truncated`: output was cut at `output_bytes` (a marker line says so; not an error)."""

    ok: bool
    output: str
    error: str | None = None
    truncated: bool = False

    def text(self) -> str:
        """The observation a model reads: the output, then the error line."""
        if self.error is None:
            return self.output
        return f"{self.output}\n[error: {self.error}]" if self.output else f"[error: {self.error}]"


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


class PythonSandbox:
    """One episode's Python tool: `await run(code)` (or `run_sync`) any number of times, then `close()`.

    temp_root: where the episode's directory is made (default: the system's temporary directory).
    namespaces: False skips the namespaces and uses the audit hook, as on a host that refuses them.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        temp_root: str | os.PathLike | None = None,
        namespaces: bool = True,
    ) -> None:
        if not sys.platform.startswith("linux"):
            raise SandboxError(f"the Python sandbox needs Linux (namespaces, prctl, /proc); this is {sys.platform}")
        self.limits = limits or SandboxLimits()
        self._namespaces = namespaces
        self.directory = Path(tempfile.mkdtemp(prefix="mint-sandbox-", dir=temp_root))
        self._state = _State(self.directory)
        self._finalizer = weakref.finalize(self, self._state.cleanup)
        self._lock = threading.Lock()
        self._closed = False
        self._isolation = ""
        try:
            self._state.worker = self._start()
        except BaseException:
            self._finalizer()
            raise

    @property
    def network_isolation(self) -> str:
        """Which isolation keeps the code off the network: "namespace" (a user and network namespace of its own) or
        "audit_hook" (the host refused namespaces, or `namespaces=False`: the interpreter refuses sockets, new
        programs and ctypes lookups)."""
        return self._isolation

    async def run(self, code: str) -> ToolResult:
        """Run `code` in the episode's namespace, in a thread (a call blocks for up to `wall_s`)."""
        return await asyncio.to_thread(self.run_sync, code)

    def run_sync(self, code: str) -> ToolResult:
        """`run`, blocking. Raises SandboxError only when the sandbox is closed."""
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if self._state.worker is None:
                try:
                    self._state.worker = self._start()
                except SandboxError as exc:  # a restart is the code's doing (it crashed one): still the tool's answer
                    return ToolResult(False, "", str(exc))
            worker = self._state.worker
            result = worker.call(code, self.limits)
            if worker.dead:
                worker.release()
                self._state.worker = None
            if self._closed:
                return ToolResult(False, result.output, "the sandbox was closed during the call", result.truncated)
            return result

    def close(self) -> None:
        """Kill the worker and every process it started, and remove the episode's directory. Idempotent."""
        self._closed = True
        worker = self._state.worker
        if worker is not None:
            worker.kill()  # not under the lock: a call in flight ends now, with an error
        with self._lock:
            self._finalizer()

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> PythonSandbox:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def _start(self) -> _Worker:
        # The code may have removed or replaced its directory (or chmod-ed it) before it crashed the last worker.
        try:
            for path in (self.directory, self.directory / "tmp"):
                if path.is_symlink() or (path.exists() and not path.is_dir()):
                    path.unlink()
                path.mkdir(mode=0o700, exist_ok=True)
                path.chmod(0o700)
        except OSError as exc:
            raise SandboxError(f"the episode's directory cannot be made: {exc}") from exc
        worker = _Worker.start(self.directory, self.limits, self._namespaces)
        self._isolation = worker.network_isolation
        return worker


class _State:
    """What the finalizer frees: held apart from the sandbox so that a forgotten sandbox can still be collected."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.worker: _Worker | None = None

    def cleanup(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker.release()
            self.worker = None
        remove_tree(self.directory)


class _Worker:
    """One worker process and its pipes. `dead` once it crashed or was killed: the sandbox then starts another."""

    def __init__(self, proc: subprocess.Popen, replies: int, directory: Path) -> None:
        self.proc, self.pid, self.replies, self.directory = proc, proc.pid, replies, directory
        self.requests, self.output = proc.stdin.fileno(), proc.stdout.fileno()
        os.set_blocking(self.output, False)
        # Readable once the worker exits. The reply pipe's end of file does not say so: a fork of the code holds a
        # copy of the reply pipe, and would keep a crashed worker's call waiting for the wall clock.
        self.exits = os.pidfd_open(self.pid)
        self.network_isolation = ""
        self.dead = False
        self._kill_lock = threading.Lock()

    @classmethod
    def start(cls, directory: Path, limits: SandboxLimits, namespaces: bool) -> _Worker:
        reply_r, reply_w = os.pipe()
        # -S: site's .pth files run code at every start (this venv's editable installs import pathlib, re and
        # urllib: 30 of the 45 ms a worker took to start). The worker puts this interpreter's site-packages on its
        # path itself, so installed packages (numpy, sympy) import and .pth-installed ones (Mint itself) do not.
        # The directory is in the command line (and so in every fork's) for `ps` and for the tests to find them by.
        config = {
            "directory": directory,
            "site_packages": os.pathsep.join(site.getsitepackages()),
            "reply_fd": reply_w,
            "namespaces": int(namespaces),
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_bytes,
            "output_bytes": limits.output_bytes,
        }
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": str(directory),
            "TMPDIR": str(directory / "tmp"),
            "LANG": "C.UTF-8",
            MARKER: str(directory),
            # Address space is the memory limit: one BLAS thread and one malloc arena keep a library's idle threads
            # from spending it (glibc reserves 64 MB per arena, and makes an arena per thread up to 8 x cores).
            "MALLOC_ARENA_MAX": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(WORKER), *(f"{key}={value}" for key, value in config.items())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(reply_w,),
                cwd=directory, env=env, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            os.close(reply_r)
            raise SandboxError(f"the sandbox worker did not start: {exc}") from exc
        finally:
            os.close(reply_w)
        try:
            worker = cls(proc, reply_r, directory)
        except OSError as exc:  # pidfd_open: Linux 5.3 or later
            proc.kill()
            proc.wait()
            raise SandboxError(f"the sandbox worker cannot be watched: {exc}") from exc
        ready, printed, _ = worker._exchange(None, limits.start_s, limits.output_bytes)
        if not (ready or {}).get("ready"):
            worker.kill()
            said = worker._drain(limits.output_bytes, printed).decode(errors="replace").strip().splitlines()
            worker.release()
            raise SandboxError(f"the sandbox worker did not start: {said[-1] if said else 'it said nothing'}")
        worker.network_isolation = ready["network_isolation"]
        return worker

    def call(self, code: str, limits: SandboxLimits) -> ToolResult:
        """Run one call; a worker that did not answer is killed (with everything it started) and marked dead."""
        cap = limits.output_bytes
        request = code.encode("utf-8", "surrogatepass")
        reply, printed, failure = self._exchange(_HEADER.pack(len(request)) + request, limits.wall_s, cap)
        strays = 0
        if reply is None:
            self.kill()
        else:
            strays = self._kill_strays()
        self._drain(cap, printed)
        truncated = len(printed) > cap or bool(reply and reply.get("truncated"))
        output = printed[:cap].decode("utf-8", errors="replace")
        if truncated:
            output = _join(output, f"[output truncated at {_size(cap)}]")
        if reply is None:
            status = self.proc.returncode
            if failure == "timeout":
                error = f"timeout after {limits.wall_s:g} s"
            elif failure == "exited" and status < 0:
                error = f"process crashed (signal {-status})"
            elif failure == "exited":
                error = f"process exited with status {status}"
            else:
                error = "the worker broke its reply protocol"
            return ToolResult(False, output, f"{error}; {_LOST}", truncated)
        output = _join(output, reply.get("value") or reply.get("detail") or "")
        errors = {
            None: None,
            "cpu": f"cpu limit ({limits.cpu_s} s) exceeded",
            "memory": f"memory limit ({_size(limits.memory_bytes)}) exceeded",
            "exception": f"exception: {reply.get('error')}",
        }
        error = errors.get(reply.get("kind"), "the worker broke its reply protocol")
        if error is None and strays:
            error = f"{strays} process(es) still running at the end of the call were killed: no process outlives a call"
        return ToolResult(error is None, output, error, truncated)

    def _exchange(self, request: bytes | None, wait_s: float, cap: int) -> tuple[dict | None, bytearray, str | None]:
        """Send `request`, then read output and the reply until the reply is whole, the worker exits, or `wait_s`
        passes. Returns (reply or None, printed bytes (at most cap + 1), None or why there is no reply)."""
        printed, reply, size = bytearray(), bytearray(), None
        try:
            view = memoryview(request or b"")
            while view:  # the worker is idle, reading: this blocks only on a request over the pipe's 64 KiB
                view = view[os.write(self.requests, view) :]
        except OSError:
            return None, printed, "exited"
        deadline = time.monotonic() + wait_s
        with selectors.DefaultSelector() as selector:
            for fd in (self.output, self.replies, self.exits):
                selector.register(fd, selectors.EVENT_READ)
            while size is None or len(reply) < _HEADER.size + size:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, printed, "timeout"
                for key, _ in selector.select(left):
                    if key.fd == self.exits:
                        return None, printed, "exited"
                    try:
                        data = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if key.fd == self.output:
                        if not data:
                            selector.unregister(self.output)  # the code closed fds 1 and 2; replies still come
                        elif len(printed) <= cap:
                            printed += data[: cap + 1 - len(printed)]  # one byte past cap marks the cut
                        continue
                    if not data:  # the worker is exiting (its files close before its exit shows) or broken
                        return None, printed, "exited" if self._exits_within(EXIT_WAIT_S) else "protocol"
                    reply += data
                    if size is None and len(reply) >= _HEADER.size:
                        size = _HEADER.unpack_from(reply)[0]
                        if size > _REPLY_FACTOR * cap + 4096:
                            return None, printed, "protocol"
        try:
            message = json.loads(reply[_HEADER.size :])
        except ValueError:
            return None, printed, "protocol"
        # The code can write on the reply pipe too: a reply that is not the worker's shape is a broken protocol.
        if len(reply) > _HEADER.size + size or not _well_formed(message):
            return None, printed, "protocol"
        return message, printed, None

    def _exits_within(self, seconds: float) -> bool:
        """The worker has exited (its children were already reparented), or does within `seconds`."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.exits, selectors.EVENT_READ)
            return bool(selector.select(seconds))

    def _drain(self, cap: int, printed: bytearray) -> bytearray:
        """Read what is already in the output pipe (non-blocking), keeping at most cap + 1 bytes in all."""
        with contextlib.suppress(OSError):
            while data := os.read(self.output, 1 << 16):
                if len(printed) <= cap:
                    printed += data[: cap + 1 - len(printed)]
        return printed

    def _kill_strays(self) -> int:
        """Kill every live descendant of the idle worker; return how many there were. The worker is stopped
        meanwhile, so threads the code left running cannot fork faster than this kills."""
        live = descendants(self.pid)
        if not live:
            return 0
        with self._kill_lock:
            if self.dead:
                return len(live)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGSTOP)
                kill_descendants(self.pid)
                os.kill(self.pid, signal.SIGCONT)
        return len(live)

    def kill(self) -> None:
        """Kill the worker, its process group and its descendants, and reap it. Safe to call twice, from any thread;
        the pipes stay open for a call in flight (`release` closes them)."""
        with self._kill_lock:
            if self.dead:
                return
            self.dead = True
            # A worker that died on its own left its descendants to init; those are found by their marker below.
            died_alone = self._exits_within(0)
            # Until it is reaped, the worker's pid stays its group's id, so these signals cannot reach anyone else.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGSTOP)  # nothing in the group forks while the tree is killed
            kill_descendants(self.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
            if died_alone:
                kill_marked(self.directory)

    def release(self) -> None:
        """Close the pipes of a killed worker."""
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        for fd in (self.replies, self.exits):
            with contextlib.suppress(OSError):
                os.close(fd)


def _well_formed(message) -> bool:
    shapes = {"kind": (str, type(None)), "value": str, "detail": str, "error": str, "truncated": bool,
              "ready": bool, "network_isolation": str, "pid": int}  # fmt: skip
    return isinstance(message, dict) and all(isinstance(v, shapes.get(k, ())) for k, v in message.items())


def _join(text: str, more: str) -> str:
    """`more` on a line of its own after `text`."""
    if not more:
        return text
    return f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{more}"
