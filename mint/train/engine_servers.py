"""Engine servers run as Ray actors (`engines.start = N`): vLLM or SGLang, or anything that speaks their protocol.

Each `EngineServer` actor launches one server as a subprocess on its node, with the argv `launch_argv` renders from
the `engines.command` template (or the backend's default launch line) and `engines.path` first on its
PATH, in a process group of its own, writes its output to a log file, and waits for the server's `/health` to
answer 200. Its URL then goes into `engines.urls` for the rollout actors, which front
the engines exactly as they front servers that already run (actor j: `urls[j::num_actors]`).

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
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from mint.config import Config
from mint.config import run_dir as default_run_dir
from mint.errors import ConfigError, MintError

# Ray is imported inside the functions that use it: preflight checks the launch line (check_launch) before Ray is.

# The documented launch lines: LoRA on, tensor parallel engines.tp, the base's dtype (vLLM on CPU would otherwise serve
# an fp32 checkpoint in bf16), routed experts on an MoE base (vLLM refuses the flag on a dense one: "No supported MoE
# router found for routed-experts capture"). `vllm serve` replaces the deprecated `python -m
# vllm.entrypoints.openai.api_server`; engines.path puts a vLLM installed in a virtualenv of its own first.
DEFAULT_COMMANDS = {
    "vllm": (
        "vllm serve {model} --host {host} --port {port} --dtype {dtype} --tensor-parallel-size {tp} --enable-lora "
        "--max-lora-rank {max_lora_rank} --max-loras 2 {routed_experts} --logprobs-mode processed_logprobs"
    ),
    "sglang": (
        "{python} -m sglang.launch_server --model-path {model} --host {host} --port {port} --dtype {dtype} "
        "--tp-size {tp} --enable-lora --max-lora-rank {max_lora_rank} --lora-target-modules {lora_modules} "
        "{routed_experts}"
    ),
}
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"  # vLLM's and SGLang's alike
# vLLM's --max-lora-rank takes only these (vllm/config/lora.py, MaxLoRARanks, as of vLLM 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# SGLang's --lora-target-modules takes only these, or "all" (sglang/srt/utils/common.py,
# SUPPORTED_LORA_TARGET_MODULES, SGLang 0.5.23).
SGLANG_LORA_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b", "wk",
    "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head", "qkvr",
    "wo_ud",
)  # fmt: skip
EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")  # per-expert LoRA module names (mint.hub.export)
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


def engine_command(config: Config) -> str:
    """The launch template of this run's engines: engines.command, else the backend's default."""
    if not config.engines.command and config.rollout.backend not in DEFAULT_COMMANDS:
        raise ConfigError(f"rollout.backend: {config.rollout.backend} starts no engine servers (use vllm or sglang)")
    return config.engines.command or DEFAULT_COMMANDS[config.rollout.backend]


def lora_modules(config: Config) -> list[str]:
    """The modules the engines' adapter directories hold LoRA for: lora.target_modules, plus the per-expert layout's
    gate_proj / up_proj / down_proj with lora.target_experts."""
    modules = [*config.lora.target_modules, *(EXPERT_MODULES if config.lora.target_experts else ())]
    return list(dict.fromkeys(modules))


def vllm_lora_rank(rank: int) -> int:
    """vLLM's --max-lora-rank for LoRA rank `rank`: the smallest rank it accepts that holds `rank` (24 -> 32).
    Above 512 there is none; `rank` itself is returned and check_launch refuses it."""
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), rank)


def check_launch(config: Config) -> None:
    """One-line ConfigError when the engines' launch line passes a value the engine refuses at start: a lora.rank
    above 512 in vLLM's {max_lora_rank}, or a lora.target_modules name outside SGLang's --lora-target-modules
    choices in {lora_modules}. Pure: preflight runs it before anything starts (for engines.start > 0)."""
    r = config.rollout
    names = {name for _, name, _, _ in string.Formatter().parse(engine_command(config)) if name}
    rank, most = config.lora.rank, VLLM_LORA_RANKS[-1]
    if r.backend == "vllm" and "max_lora_rank" in names and rank > most:
        raise ConfigError(
            f"lora.rank: {rank} is above {most}, the largest --max-lora-rank vLLM accepts (rollout.backend = vllm "
            f"with engines.start); use lora.rank <= {most}"
        )
    if r.backend == "sglang" and "lora_modules" in names:
        bad = [m for m in lora_modules(config) if m not in SGLANG_LORA_MODULES]
        if bad:
            raise ConfigError(
                f"lora.target_modules: SGLang's --lora-target-modules does not take {bad[0]!r} (rollout.backend = "
                f"sglang with engines.start); it takes {', '.join(SGLANG_LORA_MODULES)}"
            )


def launch_argv(config: Config, values: dict) -> list[str]:
    """One engine server's argv, exactly as `EngineServer` runs it: the launch template (engines.command, else
    DEFAULT_COMMANDS[rollout.backend]) split like a shell line (shlex), then each word's placeholders filled.

    config  the run's config, which gives {tp} (engines.tp), {dtype} (model.dtype), {max_lora_rank}
            (lora.rank; with rollout.backend = vllm rounded up to the next rank vLLM accepts, VLLM_LORA_RANKS),
            {lora_modules} (`lora_modules`), {adapter_dir} (engines.adapter_dir, else <run dir>/engine_adapters) and
            {python} (this process's interpreter: Mint's own Python).
    values  what the launcher knows: "model" (the base's local path, as the server loads it), "host" and "port"
            (where it listens), and optionally "index" (the engine's number; default 0) and "moe" (whether the base is
            sparse-MoE; default True): {routed_experts} is --enable-return-routed-experts only for an MoE base. A
            value given here for any other placeholder replaces the config's.

    A word that is exactly {lora_modules} or {routed_experts} becomes one argv word per item (none at all for
    {routed_experts} on a dense base); inside a longer word the items are joined by spaces. Raises ConfigError for a
    value the engine would refuse (`check_launch`). Needs no Ray and starts nothing.
    """
    check_launch(config)
    e, rank = config.engines, config.lora.rank
    fill = {
        "python": sys.executable,
        "tp": e.tp,
        "dtype": config.model.dtype,
        "max_lora_rank": vllm_lora_rank(rank) if config.rollout.backend == "vllm" else rank,
        "lora_modules": lora_modules(config),
        "adapter_dir": e.adapter_dir or str(default_run_dir(config) / "engine_adapters"),
        "index": 0,
        **{k: v for k, v in values.items() if k != "moe"},
        "routed_experts": [ROUTED_EXPERTS_FLAG] if values.get("moe", True) else [],
    }
    joined = {k: " ".join(map(str, v)) if isinstance(v, list | tuple) else v for k, v in fill.items()}
    argv = []
    for word in shlex.split(engine_command(config)):
        whole = fill.get(word[1:-1]) if word.startswith("{") and word.endswith("}") else None
        if isinstance(whole, list | tuple):
            argv.extend(str(item) for item in whole)
        else:
            argv.append(word.format(**joined))
    return argv


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
