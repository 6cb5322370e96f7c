"""Engine servers run as Ray actors (`engines.start = N`): vLLM or SGLang, or anything that speaks their protocol.

Each `EngineServer` actor launches one server as a subprocess on its node, with the argv `launch_argv`
(mint.train.engine_launch) renders from the `engines.command` template (or the backend's default launch line) and
`engines.path` first on its PATH, in a process group of its own, writes its output to a log file, and waits for the
server's `/health` to answer 200. The rollout fleet then hands its URL to the rollout actors, which front the engines
exactly as they front servers that already run (actor j: `urls[j::num_actors]`).

- A server that exits, or does not answer within `engines.start_timeout`, stops the run with one line naming
  the engine, its log and the log's last words.
- A server that dies later is restarted, up to `engines.restarts` times per engine (`EngineServers.restart_dead`,
  asked by the rollout fleet when a rollout or a revision load fails on an engine): the same argv again, so the
  same host and port and the URL the rollout actors hold stays valid; the fleet (mint.train.rollout_fleet) then has
  every rollout actor that fronts it load its current revision on it again and redoes the failed work. Past that
  budget the run ends with one line naming the engine and its log.
- `EngineServers.stop` ends every server's whole process group (SIGTERM, then SIGKILL); the fleet calls it on every
  way out of a run (end, error, Ctrl-C). The server itself also gets SIGTERM when its actor's process dies
  (PR_SET_PDEATHSIG), so a killed actor leaves no server behind.

Engines are plain Ray actors outside the run's placement group: `engines.tp` GPUs each on a run with GPUs
(`ray.learner_gpus` or `ray.rollout_gpus` > 0; Ray sets CUDA_VISIBLE_DEVICES, which the server inherits), no
resources on CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from mint.config import Config
from mint.errors import MintError
from mint.train.engine_launch import launch_argv

# Ray is imported inside the functions that use it.
HEALTH_POLL_S = 0.5
STOP_WAIT_S = 20.0
TAIL_CHARS = 300
PORT_WAIT_S = 10.0  # how long a restart waits for a killed server's port to be free again
PR_SET_PDEATHSIG = 1


def _port_taken(host: str, port: int, wait: float) -> str:
    """'' when (host, port) can be bound again (with SO_REUSEADDR, as uvicorn and vLLM bind); else why not, after
    waiting up to `wait` seconds for what is left of a killed server to let go of it."""
    deadline = time.monotonic() + wait
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return ""
            except OSError as err:
                if time.monotonic() > deadline:
                    return err.strerror or str(err)
        time.sleep(HEALTH_POLL_S)


def log_tail(path: str | Path, chars: int = TAIL_CHARS) -> str:
    """The end of a log file on one line (what the error lines quote)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    words = " | ".join(line.strip() for line in text[-chars:].splitlines() if line.strip())
    return words or "(empty log)"


class EngineServer:
    """One engine server process on this actor's node (made a Ray actor by `EngineServers.start`):
    `launch_argv(config, values)` with this node's host (or `values["host"]`: a benchmark serves on 127.0.0.1), a free
    port and `index` added, its environment os.environ + `env` with engines.path first on PATH."""

    def __init__(
        self,
        index: int,
        config: Config,
        values: dict,
        log_path: str,
        env: dict[str, str],
        max_restarts: int = 0,
        start_timeout: float = 900.0,
    ):
        self.index = index
        self.log_path = log_path
        self.max_restarts = max_restarts  # engines.restarts
        self.start_timeout = start_timeout  # engines.start_timeout: the default wait of a restart
        self.restarts = 0
        if "host" in values:
            self.host = values["host"]
        else:
            import ray

            self.host = ray.util.get_node_ip_address()
        with socket.socket() as s:  # a free port on this node (the server binds it a moment later)
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        self.argv = launch_argv(config, {**values, "host": self.host, "port": self.port, "index": index})
        self.env = {**os.environ, **env}
        if config.engines.path:
            self.env["PATH"] = os.pathsep.join(p for p in (config.engines.path, self.env.get("PATH")) if p)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - the server writes to it for as long as it runs
        self.stopped, self.start_error, self.proc = False, "", None
        self._lock = threading.Lock()
        self._launch("$")

    def _launch(self, prompt: str) -> None:
        """Start the server (argv, in a process group of its own) writing to the log, after a line `prompt argv`.
        A launch that fails sets start_error, which wait_healthy reports: an actor whose constructor raises dies
        with many lines."""
        self._log.write(f"{prompt} {shlex.join(self.argv)}\n".encode())
        self._log.flush()
        libc = ctypes.CDLL(None, use_errno=True)

        def die_with_actor():  # runs in the child between fork and exec: async-signal-safe calls only
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

        self.start_error = ""
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: stop() ends the server and all its workers
                preexec_fn=die_with_actor,
            )
        except OSError as err:
            self.start_error = f"{self.name()} could not start {self.argv[0]!r}: {err} (engines.path)"

    def name(self) -> str:
        return (
            f"rollout engine {self.index} ({self.url}, log {self.log_path} on {self.url.split('//')[1].split(':')[0]})"
        )

    def wait_healthy(self, timeout: float) -> str:
        """Wait for GET /health to answer 200; the URL, or one line when the server exits or times out."""
        if self.start_error:
            raise MintError(self.start_error)
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise MintError(
                    f"{self.name()} exited with code {code} before it was healthy: {log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise MintError(
                    f"{self.name()} did not answer /health within {timeout:g} s (engines.start_timeout): "
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(HEALTH_POLL_S)

    def status(self) -> str:
        """'' while the server runs; else one line naming the engine, its exit code and its log."""
        if self.start_error:
            return self.start_error
        code = self.proc.poll()
        if code is None or self.stopped:
            return ""
        return f"{self.name()} died with exit code {code}: {log_tail(self.log_path)}"

    def restart(self, timeout: float | None = None) -> str:
        """Launch a server that died (not one stopped by us) again with the same argv, so on the same host and port,
        and wait up to `timeout` s (default engines.start_timeout) for its /health: its URL, which the
        rollout actors already hold. A new server that exits before it is healthy counts as one more restart and is
        launched again while restarts are left. One line when it is out of restarts (engines.restarts), when
        the port cannot be bound again, or when the new server does not answer in time."""
        wait = self.start_timeout if timeout is None else timeout
        while True:
            with self._lock:
                if self.stopped:
                    raise MintError(f"{self.name()} was stopped; not restarting it")
                code = self.proc.poll() if self.proc is not None else None
                if code is None and self.proc is not None and not self.start_error:
                    return self.url  # it runs
                if self.restarts >= self.max_restarts:
                    died = (
                        f"could not start ({self.start_error})" if self.start_error else f"died with exit code {code}"
                    )
                    raise MintError(
                        f"{self.name()} {died} after {self.restarts} restart(s) (engines.restarts = "
                        f"{self.max_restarts}): {log_tail(self.log_path)}"
                    )
                self.restarts += 1
                if self.proc is not None:  # what is left of its process group (a vLLM server's workers) goes first
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                taken = _port_taken(self.host, self.port, PORT_WAIT_S)
                if taken:
                    raise MintError(
                        f"{self.name()} died with exit code {code} and cannot be restarted on the same URL: port "
                        f"{self.port} on {self.host} cannot be bound again ({taken})"
                    )
                self._launch(f"$ restart {self.restarts}:")
            try:
                return self.wait_healthy(wait)
            except MintError:
                if self.stopped or self.restarts >= self.max_restarts:  # timed out (stopped), or out of restarts
                    raise

    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def restart_count(self) -> tuple[int, int]:
        """(restarts so far, engines.restarts)."""
        return self.restarts, self.max_restarts

    def stop(self) -> int | None:
        """End the server's process group: SIGTERM, then SIGKILL after STOP_WAIT_S. Returns the server's exit code."""
        with self._lock:
            self.stopped = True
            if self.proc is None:
                self._log.close()
                return None
            for sig, wait in ((signal.SIGTERM, STOP_WAIT_S), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break  # the whole group is gone
                try:
                    self.proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
                if sig == signal.SIGTERM:  # the leader is gone; its workers in the group go too
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    break
            self._log.close()
            return self.proc.poll()


class EngineServers:
    """The engine servers a run started (`engines.start`): their actors, and every call the driver makes to them.
    The rollout fleet (mint.train.rollout_fleet) owns one and decides when a dead server is restarted."""

    def __init__(self, actors: list, urls: list[str]):
        self.actors = actors
        self.urls = urls

    @classmethod
    def start(cls, config: Config, model_path: str, run_dir: str | Path | None) -> EngineServers:
        """Start `engines.start` servers as Ray actors and wait until every one is healthy. One line naming the
        first engine that fails; the others are stopped then."""
        import ray
        from ray.exceptions import GetTimeoutError, RayTaskError
        from transformers import AutoConfig

        from mint.models.specs import moe_layout

        e = config.engines
        root = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="mint-engines-"))
        if e.path:  # a relative one is taken from here, not from the engine actor's working directory
            e = dataclasses.replace(e, path=str(Path(e.path).absolute()))
            config = dataclasses.replace(config, engines=e)
        values = {"model": model_path, "moe": moe_layout(AutoConfig.from_pretrained(model_path)) is not None}
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "TOKENIZERS_PARALLELISM": "false"}
        # A run on GPUs gives each engine engines.tp whole GPUs; the rollout actors beside them only talk HTTP, so
        # they need none (ray.rollout_gpus = 0). Tied to ray.rollout_gpus alone, the engines' GPUs forced a GPU share
        # on every rollout actor too, and on 8 GPUs (4 learner, two engines of TP 2) the fractional shares left 3
        # whole GPUs.
        on_gpus = config.ray.learner_gpus > 0 or config.ray.rollout_gpus > 0
        gpus = e.tp if on_gpus else 0
        # max_concurrency 2: stop() runs while wait_healthy() still polls (another engine failed first)
        remote = ray.remote(max_restarts=0, max_concurrency=2)(EngineServer).options(num_cpus=0, num_gpus=gpus)
        logs = [str(root / "engines" / f"engine_{i}.log") for i in range(e.start)]
        servers = cls(
            [remote.remote(i, config, values, logs[i], env, e.restarts, e.start_timeout) for i in range(e.start)], []
        )
        try:
            servers.urls = ray.get(
                [a.wait_healthy.remote(e.start_timeout) for a in servers.actors], timeout=e.start_timeout + 60
            )
        except GetTimeoutError:
            servers.stop()
            raise MintError(
                f"rollout engines: {e.start} engine(s) of {gpus:g} GPU(s) each were not up within "
                f"{e.start_timeout:g} s (engines.start_timeout); the cluster may lack free GPUs"
            ) from None
        except RayTaskError as err:  # the engine's own one line, without Ray's traceback around it
            servers.stop()
            raise MintError(str(err.cause) if isinstance(err.cause, MintError) else f"rollout engines: {err}") from None
        except BaseException:
            servers.stop()
            raise
        return servers

    def check(self) -> None:
        """Raise one line naming the first engine whose server died (or whose actor is gone); nothing when all run."""
        import ray

        for i, actor in enumerate(self.actors):
            try:
                line = ray.get(actor.status.remote(), timeout=30)
            except Exception as err:  # the actor itself is gone (its node left, or it was killed)
                line = f"rollout engine {i} is gone ({type(err).__name__})"
            if line:
                raise MintError(line)

    def restart_dead(self) -> list[tuple[str, int]]:
        """Restart every server that died (the same argv: the same URL): [(its URL, the restarts that took)], with a
        line on stderr for each. Raises one line for an engine out of restarts (engines.restarts), one that does not
        come back healthy, or one whose actor is gone."""
        import ray
        from ray.exceptions import RayTaskError

        restarted = []
        for i, actor in enumerate(self.actors):
            try:
                line = ray.get(actor.status.remote(), timeout=30)
            except Exception as err:  # the actor itself is gone (its node left, or it was killed): no restart
                raise MintError(f"rollout engine {i} is gone ({type(err).__name__})") from None
            if not line:
                continue
            before, most = ray.get(actor.restart_count.remote())
            try:  # bounded by the restart's own wait for /health (engines.start_timeout)
                url = ray.get(actor.restart.remote())
            except RayTaskError as err:  # the engine's own one line, without Ray's traceback around it
                raise MintError(" ".join(str(err.cause).split())) from None
            n, _ = ray.get(actor.restart_count.remote())
            print(f"mint: {line}; restarted it at {url} ({n}/{most}, engines.restarts)", file=sys.stderr)
            restarted.append((url, n - before))
        return restarted

    def stop(self) -> None:
        """Stop every engine's server (its whole process group), then the actors. Never raises."""
        import ray

        calls = []
        for actor in self.actors:
            with contextlib.suppress(Exception):
                calls.append(actor.stop.remote())
        for call in calls:
            with contextlib.suppress(Exception):
                ray.get(call, timeout=STOP_WAIT_S + 15)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
