"""Every rule that involves more than one key, in one place.

Three kinds, by when they run:

- section rules (`engines_rules`, `learner_rules`) run whenever the section is built (its `__post_init__`), so no
  code path holds an inconsistent section;
- `section_rules` runs whenever a whole Config is built: rules across sections (the rollout backend against the
  engines, context parallel against the learner's ranks and inner step);
- `recipe_rules` runs when a recipe is loaded (`build_config`): rules about what a run may be asked for (the run
  directory's name, ZeRO stages with LongStraw, float16), which tests may step around by building a Config by hand
  (the fp16 loss-scale test runs DeepSpeed's fp16 optimizer on a CPU learner, which no recipe may ask for).

Each raises a one-line ConfigError naming the key to change.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from mint.errors import ConfigError

if TYPE_CHECKING:
    from mint.config.schema import Config, EnginesConfig, LearnerConfig


# What engines.command may name (mint.train.engine_launch.launch_argv fills them).
ENGINE_PLACEHOLDERS = (
    "python", "model", "host", "port", "tp", "dtype", "max_lora_rank", "lora_modules", "routed_experts", "adapter_dir",
    "index",
)  # fmt: skip


def engines_rules(e: EnginesConfig) -> None:
    """Engines are started by the run or listed, not both; the launch template's placeholders are known; the URLs
    are http(s)."""
    if e.start and e.urls:
        raise ConfigError(
            "engines.start: set engines.start (servers the run starts) or engines.urls (servers that already run), "
            "not both"
        )
    fill = dict.fromkeys(ENGINE_PLACEHOLDERS, "")
    try:
        e.command.format(**fill)
    except (KeyError, IndexError, ValueError) as err:
        names = "{" + "}, {".join(fill) + "}"
        raise ConfigError(f"engines.command: bad placeholder ({err}); use {names}; a literal brace is {{{{") from None
    for url in e.urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"engines.urls: {url!r} is not an http:// or https:// URL")


def _backend_rules(config: Config) -> None:
    """An HTTP backend needs engines (listed or started), the builtin one none, and each rollout actor fronts at
    least one engine; vLLM samples with rollout.top_p = 1."""
    r, e = config.rollout, config.engines
    if r.backend == "builtin" and (e.start or e.urls):
        key = "engines.start" if e.start else "engines.urls"
        raise ConfigError(f"{key}: engine servers need rollout.backend = vllm or sglang (got builtin)")
    if r.backend != "builtin" and not e.urls and not e.start:
        raise ConfigError(
            f"engines.urls: rollout.backend = {r.backend} needs the engine servers' URLs "
            '(engines.urls = ["http://host:port"]), or engines.start = N to start them; or use '
            "rollout.backend = builtin"
        )
    if r.backend == "vllm" and r.top_p < 1:
        # vLLM's processed logprobs are those of the truncated, renormalised nucleus; the learner scores the whole
        # distribution, so the ratio (and IcePop's band) would be off on every token by log(kept mass).
        raise ConfigError(
            f"rollout.top_p: {r.top_p} < 1 with rollout.backend = vllm, whose log-probs are of the truncated "
            "distribution while the learner scores the whole one (the off-policy ratio would be wrong on every "
            "token); use rollout.top_p = 1"
        )
    n_engines = e.start or len(e.urls)
    if r.backend != "builtin" and r.num_actors > n_engines:
        raise ConfigError(
            f"rollout.num_actors: {r.num_actors} actors for {n_engines} engine(s); each actor fronts at "
            "least one engine, so use rollout.num_actors <= len(engines.urls) or engines.start"
        )


def learner_rules(learner: LearnerConfig) -> None:
    """Expert parallel divides the ranks and runs on ZeRO-1."""
    ep = learner.expert_parallel
    if ep > 1 and learner.num_ranks % ep:
        raise ConfigError(
            f"learner.expert_parallel: {ep} does not divide learner.num_ranks = {learner.num_ranks}; "
            "use a divisor of it (1 turns expert parallel off)"
        )
    if ep > 1 and learner.zero_stage != 1:
        # Stage 0 clips by the mean of the ranks' norms (each rank sees only its experts'); stage 3 partitions
        # the base, which DeepSpeed refuses with expert-parallel parameters; stage 2 is untested with them.
        raise ConfigError(
            f"learner.expert_parallel: {ep} needs learner.zero_stage = 1 (got {learner.zero_stage}): only ZeRO-1 "
            "reduces and clips expert-parallel LoRA gradients correctly"
        )


def section_rules(config: Config) -> None:
    """The rollout backend against its engines (and episodes: builtin or vllm); context parallel: its size times expert
    parallel's divides the ranks, and it runs under LongStraw's exact or detached mode."""
    _backend_rules(config)
    if config.env.name and config.rollout.backend == "sglang":
        # Episodes run token in, token out through the backends' common client; vLLM's path is tested against a real
        # server, SGLang's is not (its server needs a GPU).
        raise ConfigError(
            "env.name: multi-turn episodes run on rollout.backend = builtin or vllm (got sglang, untested with them)"
        )
    cp, ranks, ep = config.longstraw.context_parallel, config.learner.num_ranks, config.learner.expert_parallel
    if cp == 1:
        return
    if ranks % (cp * ep):
        with_ep = f" x learner.expert_parallel {ep} = {ep * cp}" if ep > 1 else ""
        raise ConfigError(
            f"longstraw.context_parallel: {cp}{with_ep} does not divide learner.num_ranks = {ranks}; "
            "use a divisor of it (1 turns context parallel off)"
        )
    if config.learner.inner_step != "longstraw" or config.longstraw.mode == "resident":
        what = f"learner.inner_step = {config.learner.inner_step}"
        if config.learner.inner_step == "longstraw":
            what = "longstraw.mode = resident"
        raise ConfigError(
            f"longstraw.context_parallel: {cp} needs learner.inner_step = longstraw in exact or detached mode "
            f"(got {what})"
        )


def recipe_rules(config: Config) -> None:
    """The run directory's name (it must stay inside logging.root), LongStraw's ZeRO stages, and float16."""
    name = config.logging.name
    if name in (".", "..") or not re.fullmatch(r"[\w.-]+", name, re.ASCII):
        raise ConfigError(f"logging.name: {name!r} is not a plain folder name (letters, digits, '.', '_', '-')")
    if not config.logging.root.strip():
        raise ConfigError("logging.root: is empty; give the folder that holds run directories (default: runs)")
    if config.learner.inner_step == "longstraw" and config.learner.zero_stage == 3:
        raise ConfigError(
            "learner.inner_step: longstraw runs the model piecewise and needs whole weights on each rank; "
            "use learner.zero_stage = 1 or learner.inner_step = naive"
        )
    if config.learner.inner_step == "longstraw" and config.learner.zero_stage == 2 and config.learner.num_ranks > 1:
        # ZeRO-2 reduces gradients inside every backward call; LongStraw makes one call per response and per prompt
        # chunk, so ranks whose prompts differ in length issue different collectives (gloo aborts, NCCL hangs).
        # Stage 1 reduces once, at the accumulation boundary.
        raise ConfigError(
            "learner.zero_stage: 2 reduces inside every backward and LongStraw runs one per response and prompt "
            "chunk, so ranks would disagree; use learner.zero_stage = 1 (LoRA gradients are small)"
        )
    if config.ray.learner_gpus == 0 and config.model.dtype == "float16":
        raise ConfigError("model.dtype: float16 needs a GPU learner (ray.learner_gpus > 0); use float32 or bfloat16")
    if config.model.dtype == "float16" and config.learner.zero_stage == 0:
        # DeepSpeed 0.19's stage-0 fp16 optimizer is not scaled inside engine.backward (only ZeRO optimizers are),
        # so fp16 gradients would run unscaled and underflow; stages 1-2 scale, and LongStraw's exact mode
        # accounts for that scale (mint.train.inner_step.StepContext.backward).
        raise ConfigError("model.dtype: float16 needs learner.zero_stage >= 1 (loss scaling); or use bfloat16")


# The combinations the rules above decide, as docs/configuration.md tabulates them. Each row is a set of overrides
# (on top of the defaults) and whether a recipe may ask for it; a test builds every row through `build_config`, so the
# table cannot drift from the rules.
COMBINATIONS: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("rollout.backend=builtin",), True, "the in-process engine; no servers"),
    (("rollout.backend=builtin", "engines.start=1"), False, "engine servers need an HTTP backend"),
    (("rollout.backend=vllm",), False, "an HTTP backend needs engines.urls or engines.start"),
    (("rollout.backend=vllm", 'engines.urls=["http://h:8000"]'), True, "servers that already run"),
    (("rollout.backend=sglang", "engines.start=2", "rollout.num_actors=2"), True, "servers the run starts"),
    (("rollout.backend=vllm", "engines.start=1", 'engines.urls=["http://h:8000"]'), False, "urls or start, not both"),
    (("rollout.backend=vllm", "engines.start=1", "rollout.num_actors=2"), False, "each rollout actor fronts an engine"),
    (("rollout.backend=vllm", "engines.start=1", "rollout.top_p=0.9"), False, "vLLM's logprobs are of the nucleus"),
    (("rollout.backend=sglang", "engines.start=1", "rollout.top_p=0.9"), True, "SGLang's are of the whole softmax"),
    (("env.name=retry",), True, "multi-turn episodes on the built-in engine"),
    (("env.name=retry", "rollout.backend=vllm", 'engines.urls=["http://h:8000"]'), True, "episodes on vLLM"),
    (("env.name=retry", "rollout.backend=sglang", 'engines.urls=["http://h:8000"]'), False, "not yet on SGLang"),
    (("learner.inner_step=longstraw", "learner.zero_stage=1"), True, "the default"),
    (("learner.inner_step=longstraw", "learner.zero_stage=2", "learner.num_ranks=1"), True, "one rank: no collectives"),
    (("learner.inner_step=longstraw", "learner.zero_stage=2", "learner.num_ranks=2"), False, "ranks would disagree"),
    (("learner.inner_step=longstraw", "learner.zero_stage=3"), False, "LongStraw needs whole weights"),
    (("learner.inner_step=naive", "learner.zero_stage=3"), True, "ZeRO-3 shards the base"),
    (("learner.expert_parallel=2", "learner.num_ranks=2", "learner.zero_stage=1"), True, "EP on ZeRO-1"),
    (("learner.expert_parallel=2", "learner.num_ranks=2", "learner.zero_stage=2"), False, "EP needs ZeRO-1"),
    (("learner.expert_parallel=2", "learner.num_ranks=3"), False, "EP divides the ranks"),
    (("longstraw.context_parallel=2", "learner.num_ranks=2"), True, "CP under LongStraw exact"),
    (("longstraw.context_parallel=2", "learner.num_ranks=2", "longstraw.mode=resident"), False, "not resident"),
    (("longstraw.context_parallel=2", "learner.num_ranks=2", "learner.inner_step=naive"), False, "LongStraw only"),
    (("model.dtype=float16",), False, "float16 needs a GPU learner"),
    (("model.dtype=float16", "ray.learner_gpus=1", "learner.zero_stage=0"), False, "no loss scaling at stage 0"),
    (("model.dtype=float16", "ray.learner_gpus=1", "learner.zero_stage=1"), True, "loss-scaled fp16 on GPUs"),
    (("model.dtype=bfloat16",), True, "CPU or GPU"),
)
