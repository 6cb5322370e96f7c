"""Issue 13: engine servers started under Ray (`rollout.engines = N`, mint.train.engines).

- A training run with rollout.backend = vllm and one engine: `mint serve` (our vLLM stand-in) launched by an
  EngineServer actor from rollout.engine_command, fronted by the rollout actor, learns the smoke task, and no server
  process is left once the run has ended.
- An engine command that exits at once stops the run with one line naming the engine and its log.
- A server that dies mid-run ends the run with one line naming the engine and its log.
- The config refuses engines with rollout.urls, with the builtin backend, and more actors than engines.
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from mint.config import load_config
from mint.config.load import build_config
from mint.errors import ConfigError, MintError
from mint.hub.catalog import Catalog
from mint.train.driver import train

ROOT = Path(__file__).resolve().parents[1]


def _serve_command(catalog: Path) -> str:
    """`mint serve` launched as vLLM would be: host, port and base from the template, routed experts on."""
    return (
        f"env OMP_NUM_THREADS=1 {{python}} -m mint.cli serve --base {{model}} --catalog {catalog} --host {{host}} "
        "--port {port} --adapter-root {adapter_dir} --enable-return-routed-experts"
    )


def _config(tmp_path: Path, name: str, steps: int, command: str, *extra: str):
    adapters = tmp_path / "adapters"
    adapters.mkdir(exist_ok=True)
    return load_config(
        ROOT / "recipes/smoke.toml",
        [
            f"grpo.steps={steps}",
            "learner.num_ranks=1",
            "rollout.backend=vllm",
            "rollout.engines=1",
            f"rollout.engine_command={json.dumps(command)}",
            "rollout.engine_start_timeout=120",
            f"rollout.adapter_dir={adapters}",
            f"logging.root={tmp_path}",
            f"logging.name={name}",
            "logging.progress=false",
            *extra,
        ],
    )


def _processes_with(marker: str) -> list[int]:
    """Process ids whose command line contains `marker` (a path unique to one test)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def test_training_through_an_engine_started_under_ray_learns_and_leaves_no_server(tmp_path):
    catalog = tmp_path / "engine-catalog"
    Catalog(catalog).close()  # the server's own catalog stays empty: revisions come as directories
    steps = 30
    summary = train(_config(tmp_path, "engines", steps, _serve_command(catalog)))
    lines = [json.loads(line) for line in (tmp_path / "engines/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1)) and summary["steps"] == steps
    for m in lines:  # the engine's logprobs and routes are the learner's, as with rollout.urls
        assert m["logp_diff_max"] < 1e-4 and m["trust_kept_frac"] == 1.0, m
    rewards = [m["reward_mean"] for m in lines]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.1, rewards
    log = (tmp_path / "engines/engines/engine_0.log").read_text()
    assert "mint.cli serve" in log and "--enable-return-routed-experts" in log
    assert _processes_with(str(catalog)) == [], "an engine server outlived the run"


def test_an_engine_that_exits_at_once_is_one_clear_line(tmp_path):
    command = "{python} -c \"import sys; print('no such model: {model}'); sys.exit(3)\""
    with pytest.raises(MintError) as info:
        train(_config(tmp_path, "dead", 2, command))
    message = str(info.value)
    assert "\n" not in message, message
    assert "rollout engine 0" in message and "exited with code 3" in message, message
    assert str(tmp_path / "dead/engines/engine_0.log") in message and "no such model" in message, message


def test_an_engine_that_dies_mid_run_ends_it_with_one_line(tmp_path):
    catalog = tmp_path / "dying-catalog"
    Catalog(catalog).close()
    metrics = tmp_path / "dying/metrics.jsonl"

    def kill_after_two_steps():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                for pid in _processes_with(str(catalog)):
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_after_two_steps, daemon=True)
    killer.start()
    with pytest.raises(MintError) as info:
        train(_config(tmp_path, "dying", 200, _serve_command(catalog)))
    killer.join()
    message = str(info.value)
    assert "\n" not in message, message
    assert "rollout engine 0" in message and "died with exit code -9" in message, message
    assert str(tmp_path / "dying/engines/engine_0.log") in message, message
    assert _processes_with(str(catalog)) == []


def test_the_config_checks_engines():
    with pytest.raises(ConfigError, match=r"rollout\.engines"):
        build_config({"rollout": {"backend": "vllm", "engines": 1, "urls": ["http://127.0.0.1:1"]}})
    with pytest.raises(ConfigError, match=r"rollout\.engines"):
        build_config({"rollout": {"backend": "builtin", "engines": 1}})
    with pytest.raises(ConfigError, match=r"rollout\.num_actors"):
        build_config({"rollout": {"backend": "sglang", "engines": 1, "num_actors": 2}})
    with pytest.raises(ConfigError, match=r"rollout\.engine_command: bad placeholder \('gpus'\)"):
        build_config({"rollout": {"backend": "vllm", "engines": 1, "engine_command": "serve --tp {gpus}"}})
    config = build_config({"rollout": {"backend": "sglang", "engines": 2, "num_actors": 2, "engine_tp": 2}})
    assert config.rollout.engines == 2 and config.rollout.urls == []
