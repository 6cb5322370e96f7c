"""A real vLLM server in the loop: vLLM's CPU build (`make engines` installs it into .engines/vllm), not an imitation.

- A GRPO run on the dense tiny Qwen3 (`tiny:qwen3`, head_dim 32: vLLM's CPU attention refuses 16) with
  rollout.backend = vllm and engines.start = 1 on the default launch line (`vllm serve ...`): every step's adapter
  is hot-loaded into the server (/v1/load_lora_adapter, in place), the learner's logprobs of the engine's tokens equal
  the engine's at every step (fp32), the run learns the smoke task, and the server, SIGKILLed mid-run, is restarted on
  its URL and the run finishes.
- A tiny Qwen3-MoE served without LoRA (vLLM's CPU build runs MoE LoRA only through Triton, which has no CPU
  backend): tokens (greedy) and logprobs (sampled) through Mint's vllm backend equal the learner's.

vLLM on CPU reserves `VLLM_CPU_KVCACHE_SPACE` GiB for its KV cache (by default 92% of a NUMA node's memory, which
fails beside the test's other processes); 1 GiB holds a million tiny-model tokens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import headroom_closed, kill_when_logged, new_run_mark, processes_of_run, run_mark_env

from longstraw.scoring import token_logprobs
from mint.config import load_config
from mint.models.specs import moe_layout, tiny_config
from mint.models.tiny import build_tokenizer
from mint.rollout.backends import VllmBackend
from mint.rollout.engine import SamplingParams
from mint.train.driver import train

ROOT = Path(__file__).resolve().parents[1]
KV_CACHE_GIB = "1"
START_TIMEOUT_S = 600  # measured 30-100 s on 2 cores; Ray workers and other tests share them

pytestmark = pytest.mark.slow


def test_a_grpo_run_through_a_real_vllm_learns_with_the_learners_logprobs_and_survives_a_killed_server(
    tmp_path, engine_python, monkeypatch, capfd
):
    mark = new_run_mark()
    for name, value in run_mark_env(mark).items():
        monkeypatch.setenv(name, value)  # reaches the server through Ray's workers
    servers = lambda: processes_of_run(mark, "vllm serve")  # the API server; the restart ends its process group
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    steps, kill_at = 40, 10
    config = load_config(
        ROOT / "recipes/smoke.toml",
        [
            "model.path=tiny:qwen3",
            f"grpo.steps={steps}",
            "learner.num_ranks=1",
            "rollout.backend=vllm",
            "engines.start=1",
            f"engines.path={engine_python.parent}",
            f"engines.start_timeout={START_TIMEOUT_S}",
            f"logging.root={tmp_path}",
            "logging.name=vllm",
            "logging.progress=false",
        ],
    )
    metrics, killed = tmp_path / "vllm/metrics.jsonl", []
    killer = kill_when_logged(metrics, servers, kill_at, killed, wait_s=START_TIMEOUT_S + 300)
    summary = train(config)
    killer.join()

    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1)) and summary["steps"] == steps
    # Every sample came from the server holding the step's revision, under the learner's numerics: a server that
    # sampled the base, an older revision, a bf16 copy or raw-logit logprobs would be off by far more than 1e-4.
    for m in lines:
        assert m["logp_diff_max"] <= 1e-4, m
    log = (tmp_path / "vllm/engines/engine_0.log").read_text()
    launch = log.splitlines()[0]
    assert " serve " in launch and "--enable-lora" in launch and "--dtype float32" in launch, launch
    # One in-place load per published revision: steps - 1 before the restart and after, plus the reinstall on the
    # restarted server (uvicorn's access log on the server's output).
    assert log.count("POST /v1/load_lora_adapter") >= steps, log.count("POST /v1/load_lora_adapter")
    # The kill: one restart on the same URL, counted, and the run went on with the learner's logprobs (above).
    assert killed and killed[0] < steps, killed
    assert lines[-1]["engine_restarts"] == 1 and log.count("$ restart 1: ") == 1, log[-2000:]
    assert any("restarted it at" in line for line in capfd.readouterr().err.splitlines())
    # It learned: rewards over the last 8 steps against the first 8, and the share of the headroom it closed.
    rewards = [m["reward_mean"] for m in lines]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last - first >= 0.3 and headroom_closed(first, last) >= 0.5, rewards
    assert servers() == [], "a vLLM server outlived the run"


# ---- a tiny Qwen3-MoE served as a base policy ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode} before it was healthy: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"vLLM did not answer /health in {START_TIMEOUT_S} s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def tiny_moe_on_vllm(engine_python, tmp_path_factory):
    """(model directory, URL) of a random tiny Qwen3-MoE (head_dim 32) served by vLLM on 127.0.0.1, without LoRA."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("qwen3_moe_hd32")
    tokenizer = build_tokenizer()
    config = tiny_config("qwen3_moe", len(tokenizer), head_dim=32, initializer_range=0.05)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    port, log = _free_port(), directory / "vllm.log"
    argv = [
        str(engine_python.parent / "vllm"),
        "serve",
        str(directory),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--logprobs-mode",
        "processed_logprobs",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log)
        yield directory, url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _learner_logprobs(model, prompt: list[int], tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, tokens, temperature)


def test_a_tiny_moe_served_by_vllm_samples_the_learners_tokens_and_logprobs(tiny_moe_on_vllm):
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, url = tiny_moe_on_vllm
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    backend = VllmBackend([url], moe_layout(config), timeout=120.0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 300, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    try:
        backend.check_health()
        sampled = backend.generate(prompts, 4, SamplingParams(temperature=1.0, max_tokens=8), seed=7)
        greedy = backend.generate(prompts, 1, SamplingParams(temperature=0.0, max_tokens=8), seed=7)
    finally:
        backend.close()
    worst = 0.0
    for prompt, group in zip(prompts, sampled, strict=True):
        assert len(group.completions) == 4
        for completion in group.completions:
            learner = _learner_logprobs(model, prompt, completion.tokens_R, 1.0)
            worst = max(worst, float((learner - completion.logprobs_R).abs().max()))
    assert worst <= 1e-4, worst
    for prompt, group in zip(prompts, greedy, strict=True):  # greedy: each token is the learner's argmax
        tokens = group.completions[0].tokens_R
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens.tolist()])).logits[0, len(prompt) - 1 : -1]
        assert tokens.tolist() == logits.argmax(-1).tolist(), (prompt, tokens)


def test_preflight_refuses_r3_on_a_vllm_engine_started_without_routed_experts(tiny_moe_on_vllm, tmp_path):
    """A real vLLM serving a tiny Qwen3-MoE without --enable-return-routed-experts, named in engines.urls, with R3 on
    (the default). It returns no routes, so every response token was masked route_missing, the LoRA gradient was zero
    and the run went to its last step and exited 0 having learned nothing. Preflight now asks the engine for one
    routed sample and refuses in one line naming the engine and the fix, as `mint train` does (exit 2, before Ray);
    with grpo.r3 = false the same recipe passes."""
    from mint.errors import ConfigError
    from mint.train.preflight import preflight

    directory, url = tiny_moe_on_vllm
    overrides = [
        f"model.path={directory}",
        "rollout.backend=vllm",
        f'engines.urls=["{url}"]',
        "learner.num_ranks=1",
        f"logging.root={tmp_path}",
        "logging.name=r3",
    ]
    with pytest.raises(ConfigError) as err:
        preflight(load_config(ROOT / "recipes/smoke.toml", overrides))
    message = str(err.value)
    assert message.startswith(f"grpo.r3: the vllm engine at {url} sent no expert routes"), message
    assert "--enable-return-routed-experts" in message and "grpo.r3=false" in message and "\n" not in message
    preflight(load_config(ROOT / "recipes/smoke.toml", [*overrides, "grpo.r3=false"]))

    ray_tmp = tmp_path / "ray-tmp"  # where a Ray started by `mint train` would put its session directory
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    cmd = [sys.executable, "-m", "mint.cli", "train", "recipes/smoke.toml", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "sent no expert routes" in lines[0], proc.stderr[-3000:]
    assert not ray_tmp.exists() and not (tmp_path / "r3").exists(), "refused only after starting the run"


def test_episodes_on_a_real_vllm_are_token_in_token_out(tiny_moe_on_vllm):
    """Multi-turn episodes through Mint's vllm backend (mint.rollout.episodes): every turn sends the episode's ids as
    they stand (actions as sampled, observations as given, never re-rendered), so the engine's logprob of each sampled
    token, later turns included, is the learner's at the same position of one forward over the whole episode. The
    server records no routes here, and the episodes say so (None) rather than carry a partial record."""
    import asyncio

    from test_episodes import Builder, Echo
    from transformers import AutoConfig, AutoModelForCausalLM

    from mint.envs import EpisodeLimits, StopCondition, run_group
    from mint.rollout.episodes import EnginePolicy

    directory, url = tiny_moe_on_vllm
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    backend = VllmBackend([url], moe_layout(AutoConfig.from_pretrained(directory)), timeout=120.0)
    gen = torch.Generator().manual_seed(4)
    prompt, observation = (torch.randint(5, 300, (n,), generator=gen).tolist() for n in (9, 6))
    envs = [Echo(prompt, observation, 3, StopCondition((), 5)) for _ in range(3)]
    policy = EnginePolicy(backend, revision="base", temperature=1.0, seed=11)
    try:
        episodes = asyncio.run(run_group(Builder(envs), policy, EpisodeLimits(), key="vllm"))
    finally:
        backend.close()
    assert policy.batches == 3  # each turn of the three episodes went out as one round of requests
    for env, ep in zip(envs, episodes, strict=True):
        assert ep.tokens == env.actions[0] + observation + env.actions[1] + observation + env.actions[2]
        assert ep.routes is None and len(ep.turns) == 3
        sampled = [bool(m) for m in ep.loss_mask]
        ids = torch.tensor([ep.prompt + ep.tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(ep.prompt) - 1 : -1]
        learner = token_logprobs(logits, ids[0, len(ep.prompt) :], 1.0)[sampled]
        engine = torch.tensor(ep.logprobs)[sampled]
        assert float((learner - engine).abs().max()) <= 1e-4


def test_the_tool_use_recipe_learns_through_a_real_vllm(tmp_path, engine_python, monkeypatch):
    """recipes/tool_use_cpu.toml with rollout.backend = vllm on its dense tool base (vLLM's CPU build serves LoRA on
    dense bases only), 20 steps: every turn of every episode is sampled by the server holding the step's revision,
    token in, token out (the learner's logprobs of the sampled tokens equal the server's), and GRPO raises the rate
    at which the policy calls the tool."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    config = load_config(
        ROOT / "recipes/tool_use_cpu.toml",
        [
            f"model.path={ROOT / 'mint/models/tiny_tool_bases/qwen3-lookup'}",
            "grpo.steps=20",
            "rollout.backend=vllm",
            "engines.start=1",
            f"engines.path={engine_python.parent}",
            f"engines.start_timeout={START_TIMEOUT_S}",
            f"logging.root={tmp_path}",
            "logging.name=tools",
            "logging.progress=false",
        ],
    )
    summary = train(config)
    lines = [json.loads(line) for line in (tmp_path / "tools/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 21))
    for m in lines:
        assert m["logp_diff_max"] <= 1e-4 and 1.0 <= m["turns_mean"] <= 2.0, m
    first, last = summary["reward_first"], summary["reward_last"]
    assert headroom_closed(first, last) >= 0.5 and last - first >= 0.3, (first, last)
    assert lines[-1]["turns_mean"] > 1.5 and lines[-1]["turns_mean"] > lines[0]["turns_mean"]
