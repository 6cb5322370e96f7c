"""The engine servers' launch lines, pure: what `engines.command` (or the backend's default) renders to, the LoRA
modules and ranks an engine takes, and the checks preflight runs on them before anything starts. No Ray and no
process here: mint.train.engine_servers starts the servers with these argv.
"""

from __future__ import annotations

import shlex
import string
import sys

from mint.config import Config
from mint.config import run_dir as default_run_dir
from mint.errors import ConfigError

# The documented launch lines: LoRA on, tensor parallel engines.tp, the base's dtype (vLLM on CPU would otherwise serve
# an fp32 checkpoint in bf16), routed experts on an MoE base (vLLM refuses the flag on a dense one: "No supported MoE
# router found for routed-experts capture"). `vllm serve` replaces the deprecated `python -m
# vllm.entrypoints.openai.api_server`; engines.path puts a vLLM installed in a virtualenv of its own first.
# {cpu_only}: on an engine without GPUs (ray.rollout_gpus = 0), --no-enable-chunked-prefill. vLLM's CPU build (0.32)
# rewinds a seeded request's generator when a step samples for a prefill it has only partly run, and a CPU generator
# has no offset to rewind: the server dies ("CPU Generator does not use offset"). Mint seeds every request, and
# episodes send many long contexts at once, which the scheduler chunks.
DEFAULT_COMMANDS = {
    "vllm": (
        "vllm serve {model} --host {host} --port {port} --dtype {dtype} --tensor-parallel-size {tp} --enable-lora "
        "--max-lora-rank {max_lora_rank} --max-loras 2 {routed_experts} --logprobs-mode processed_logprobs "
        "{cpu_only}"
    ),
    "sglang": (
        "{python} -m sglang.launch_server --model-path {model} --host {host} --port {port} --dtype {dtype} "
        "--tp-size {tp} --enable-lora --max-lora-rank {max_lora_rank} --lora-target-modules {lora_modules} "
        "{routed_experts}"
    ),
}
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"  # vLLM's and SGLang's alike
NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"
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

    {cpu_only} is --no-enable-chunked-prefill for an engine without GPUs (ray.rollout_gpus = 0), else nothing.
    A word that is exactly {lora_modules}, {routed_experts} or {cpu_only} becomes one argv word per item (none at
    all for an empty one); inside a longer word the items are joined by spaces. Raises ConfigError for a
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
        "cpu_only": [NO_CHUNKED_PREFILL] if config.ray.rollout_gpus == 0 else [],
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
