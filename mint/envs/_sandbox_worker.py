"""The process that runs one episode's Python tool calls (mint.envs.sandbox starts it and owns its whole tree).

Started as `python -I -S _sandbox_worker.py key=value ...` in a session of its own, in the episode's directory, with
fd 0 the request pipe, fds 1 and 2 one output pipe, and `reply_fd` the reply pipe. Before any code of the episode
runs it:

1. becomes a child subreaper: an orphan anywhere below it (a double fork, a `setsid` grandchild) is reparented to
   it rather than to init, so the parent finds every process the code started among its descendants;
2. moves into a new user and network namespace (no interface but a loopback that is down, so no socket reaches
   anything), or, where the host refuses namespaces, installs an audit hook that refuses sockets, new programs and
   native calls through ctypes;
3. caps its address space (inherited by every fork) and disables core files.

Then it loops: read a request (4-byte big-endian length, then the code as UTF-8) from fd 0, run the code in the
episode's one namespace, write the reply (length, then JSON) on the reply pipe. Output goes straight to fd 1, at most
`output_bytes` a call from `print` (the parent caps what arrives by other paths: os.write, a subprocess).

Only the standard library, and little of it: a worker starts per episode, so its imports are its start-up time.
`_ast`, `_signal` and `_json` are the C modules behind ast, signal and json, whose Python wrappers import enum, re
and collections (about 14 of the 31 ms of CPU a start took on the test machine); traceback is imported on the first
failure. Nothing it reports is trusted by the parent for cleanup: the code runs in this process and can patch any of
it.
"""

from __future__ import annotations

import _ast
import _json
import _signal as signal
import builtins
import ctypes
import math
import os
import resource
import struct
import sys
import time
import types

HEADER = struct.Struct(">I")
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_CHILD_SUBREAPER = 36
# A failed call's last traceback lines: the frame that raised and a few callers, enough for a model to fix its code;
# the whole chain of a deep recursion would fill the output.
TRACEBACK_LINES = 20
# The one-line error keeps this many characters of the exception's message.
MESSAGE_CHARS = 200
# Audit events refused when namespaces are unavailable: a socket; a new program, which would run without this
# hook; a native symbol looked up through ctypes (libc's connect, say). Forks keep the hook, so they are allowed.
REFUSED_EVENTS = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "ctypes.dl")


class CpuLimit(BaseException):
    """Raised in the running code by SIGXCPU, which the kernel sends once the call's CPU seconds are spent.
    A BaseException so that `except Exception` in the code does not swallow it."""


def _on_sigxcpu(signum, frame):
    raise CpuLimit


def _reap(signum=None, frame=None) -> None:
    """Wait for every child that has exited: between calls the parent kills what a call left running, and this
    process (their subreaper) must collect them, or they stay zombies until it exits."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _refuse(event: str, args) -> None:
    if event.startswith(REFUSED_EVENTS):
        raise PermissionError(f"{event} is disabled in this sandbox (no network, no new programs, no native calls)")


def _isolate(namespaces: bool) -> str:
    """Become a subreaper and unshare a user and a network namespace; say which isolation is in force. The audit
    hook is installed later, once this process has made its own ctypes calls."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    if namespaces and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return "namespace"
    return "audit_hook"


class _Budget:
    """What a call may still print: bytes left, and whether something was dropped."""

    def __init__(self) -> None:
        self.room = 0
        self.dropped = False

    def reset(self, room: int) -> None:
        self.room, self.dropped = room, False


class _BinaryOutput:
    """sys.stdout.buffer: bytes to fd 1 until the call's budget is spent, the rest dropped (and counted as written,
    so the code goes on as it would with a terminal)."""

    closed = False

    def __init__(self, budget: _Budget) -> None:
        self._budget = budget

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        keep = view[: self._budget.room]
        if len(keep) < len(view):
            self._budget.dropped = True
        self._budget.room -= len(keep)
        while keep:
            keep = keep[os.write(1, keep) :]
        return len(view)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return 1

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False


class _TextOutput(_BinaryOutput):
    """sys.stdout and sys.stderr (one stream, so the order of their lines is kept). It slices before encoding: a
    100 MB string costs the budget's worth of work, not 100 MB of copies."""

    encoding = "utf-8"
    errors = "backslashreplace"

    def __init__(self, budget: _Budget) -> None:
        super().__init__(budget)
        self.buffer = _BinaryOutput(budget)

    def write(self, text) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self._budget.room
        # A character is at least one byte, so `room` characters cover the budget.
        super().write(text[:room].encode("utf-8", "backslashreplace"))
        if len(text) > room:
            self._budget.dropped = True
        return len(text)


def _clip(text: str, limit: int) -> tuple[str, bool]:
    """`text` as valid UTF-8 of at most `limit` bytes, and whether it was cut."""
    data = text.encode("utf-8", "backslashreplace")
    return data[:limit].decode("utf-8", "ignore"), len(data) > limit


def _message(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:
        text = ""
    first = text.splitlines()[0] if text.strip() else ""
    name = type(error).__name__
    return _clip(f"{name}: {first}" if first else name, MESSAGE_CHARS)[0]


def _traceback(error: BaseException, sources: dict[str, str]) -> str:
    """The traceback's last lines without this file's frames; the code's own frames are named `<call N>` and show
    their source lines."""
    import linecache
    import traceback

    for filename, code in sources.items():
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    summary = traceback.TracebackException.from_exception(error)
    if isinstance(error, SyntaxError):
        summary.stack = traceback.StackSummary()  # raised while parsing: no frame is the code's
    else:
        summary.stack = traceback.StackSummary.from_list([f for f in summary.stack if f.filename != __file__])
    lines = "".join(summary.format()).splitlines()
    return "\n".join(lines[-TRACEBACK_LINES:])


def _call(code: str, namespace: dict, filename: str, sources: dict[str, str], cap: int) -> dict:
    """Run one call's code; the value of a final expression is kept as `_`, as in the interactive interpreter."""
    try:
        tree = compile(code, filename, "exec", _ast.PyCF_ONLY_AST, dont_inherit=True)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
        exec(compile(tree, filename, "exec", dont_inherit=True), namespace)
        if last is None:
            return {"kind": None}
        value = eval(compile(_ast.Expression(last.value), filename, "eval", dont_inherit=True), namespace)
        if value is None:
            return {"kind": None}
        namespace["_"] = value
        text, cut = _clip(repr(value), cap)
        return {"kind": None, "value": text + ("\n[repr truncated]" if cut else ""), "truncated": cut}
    except CpuLimit:
        return {"kind": "cpu"}
    except MemoryError:
        return {"kind": "memory"}
    except BaseException as error:  # the code's failure is the tool's answer, whatever it is (SystemExit too)
        return {"kind": "exception", "error": _message(error), "detail": _clip(_traceback(error, sources), cap)[0]}


def _abandon(directory: str, parent: int) -> None:
    """The request pipe closed. If the parent is gone (killed: a normal close kills this process first), kill what
    the code left running and remove the episode's directory, so that a parent killed by SIGKILL leaves nothing
    behind. If the parent is alive the code closed the pipe: exit, and the parent cleans up as after any crash."""
    # A dying parent's pipes close a moment before its children are reparented: give that moment a second.
    for _ in range(100):
        if os.getppid() != parent:
            break
        time.sleep(0.01)
    else:
        os._exit(1)
    import contextlib
    import shutil

    parents = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            parents[int(name)] = int(stat[stat.rfind(b")") + 2 :].split(b" ", 2)[1])
        except (OSError, ValueError):
            continue
    todo = [os.getpid()]
    while todo:
        node = todo.pop()
        for pid, ppid in parents.items():
            if ppid == node:
                todo.append(pid)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)
    os._exit(0)


def _read_exact(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _send(fd: int, message: dict) -> None:
    """Write `message` (str, bool, int or None values) as JSON, encoded by hand: the json package imports re."""
    fields = []
    for key, value in message.items():
        if isinstance(value, str):
            text = _json.encode_basestring_ascii(value)
        elif value is None or isinstance(value, bool):
            text = {None: "null", True: "true", False: "false"}[value]
        else:
            text = str(int(value))
        fields.append(f'"{key}": {text}')
    data = ("{" + ", ".join(fields) + "}").encode()
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _arm_cpu_limit(cpu_s: int) -> None:
    """RLIMIT_CPU counts the process's lifetime, so each call's soft limit is what it has used plus `cpu_s`. The hard
    limit stays unlimited: this process cannot raise a hard limit back (no privilege outside its namespace), and a
    code that lifts its own soft limit still meets the parent's wall clock."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime) + cpu_s
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXCPU, _on_sigxcpu)


def _disarm_cpu_limit() -> None:
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def main() -> None:
    config = dict(arg.split("=", 1) for arg in sys.argv[1:])
    directory, cap = config["directory"], int(config["output_bytes"])
    sys.path += [path for path in config["site_packages"].split(os.pathsep) if path]
    requests, replies = os.dup(0), int(config["reply_fd"])
    os.set_inheritable(replies, False)  # a program the code starts must not write replies
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # input() reads end of file
    os.close(devnull)
    isolation = _isolate(config["namespaces"] == "1")
    memory = int(config["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolation == "audit_hook":
        sys.addaudithook(_refuse)

    budget, me, parent = _Budget(), os.getpid(), os.getppid()
    sys.stdout = sys.stderr = sys.__stdout__ = sys.__stderr__ = _TextOutput(budget)
    # The code's namespace is a real __main__ module, so functions and classes it defines pickle by reference
    # (multiprocessing, copy) as they would in a script.
    main_module = types.ModuleType("__main__")
    main_module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main_module
    sources: dict[str, str] = {}
    _send(replies, {"ready": True, "network_isolation": isolation, "pid": me})

    while True:
        signal.signal(signal.SIGCHLD, _reap)
        header = _read_exact(requests, HEADER.size)
        body = header and _read_exact(requests, HEADER.unpack(header)[0])
        if body is None:
            _abandon(directory, parent)
        code = body.decode("utf-8", "surrogatepass")
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the code's own subprocess.wait must see its children exit
        _reap()
        filename = f"<call {len(sources) + 1}>"
        sources[filename] = code
        budget.reset(cap)
        try:
            _arm_cpu_limit(int(config["cpu_s"]))
            reply = _call(code, main_module.__dict__, filename, sources, cap)
        except CpuLimit:  # the signal landed outside _call's try, in this loop's own lines
            reply = {"kind": "cpu"}
        finally:
            _disarm_cpu_limit()
        if os.getpid() != me:
            os._exit(0)  # a fork of the code got back here: only the worker answers
        reply["truncated"] = budget.dropped or reply.get("truncated", False)
        try:
            _send(replies, reply)
        except OSError:  # the parent died during the call (or the code closed the reply pipe)
            _abandon(directory, parent)


if __name__ == "__main__":
    main()
