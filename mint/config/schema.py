"""The recipe schema: one frozen dataclass per [section], each field a `knob` with its default, help and range.

Derived values come from pure functions (mint.config.load), never by rewriting a config in place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from mint.config.knobs import knob
from mint.config.rules import engines_rules, learner_rules, section_rules
from mint.config.sections import CatalogConfig, CheckpointConfig, EvalConfig, LoggingConfig, RayConfig


@dataclass(frozen=True)
class ModelConfig:
    path: str = knob(
        "tiny:qwen3_moe",
        "Base model: a hub id, a local directory, or tiny:<family> for the embedded tiny bases (never downloaded): "
        "qwen3_moe, qwen2_moe, glm4_moe, qwen3 (dense), the Gated DeltaNet hybrids qwen3_5_moe, qwen3_next, "
        "qwen3_5 (dense), and the multi-head latent attention MoEs deepseek_v3, glm4_moe_lite and glm_moe_dsa "
        "(GLM-5's DSA).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = knob("float32", "Dtype of the LoRA and the compute (and base).")
    quantization: Literal["auto", "none", "fp8", "int4"] = knob(
        "auto",
        "fp8: an FP8 block-scaled checkpoint kept FP8; int4: a compressed-tensors pack-quantized one kept packed; "
        "both dequantized per matmul. auto: the checkpoint's own.",
    )


@dataclass(frozen=True)
class LoraConfig:
    rank: int = knob(8, "LoRA rank r.", min=1, max=1024)
    alpha: float = knob(16.0, "LoRA alpha; the update is scaled by alpha / rank.", gt=0)
    dropout: float = knob(0.0, "Dropout on the LoRA input.", min=0.0, max=0.9)
    target_modules: list[str] = knob(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "Linear modules that get LoRA (attention projections by default)."
    )
    target_experts: bool = knob(
        True, "Also put LoRA on the fused 3-D routed experts (gate_up_proj, down_proj) through PEFT target_parameters."
    )
    init: str = knob(
        "",
        "Warm start: a revision whose LoRA weights start this run (with a fresh optimizer): a ref in the run's "
        "catalog (id, id prefix, name, RUN@STEP) or a revision directory (an exported adapter); empty: PEFT's init.",
    )


@dataclass(frozen=True)
class DataConfig:
    source: str = knob(
        "synthetic:first_last",
        "Prompts: synthetic:<task> for a built-in task, or a .jsonl / .parquet file with prompt and answer fields.",
    )
    prompt_key: str = knob("prompt", "Field holding the prompt (the user message) in a file dataset.")
    answer_key: str = knob("answer", "Field holding the reference answer in a file dataset.")
    reward: str = knob(
        "exact_match",
        "Reward: one or more name[:weight], comma-separated (the reward is the weighted sum, each logged as "
        "reward/<name>); built-ins exact_match, math_verify, math (= math_verify), math_rules, or pkg.module:fn "
        "called as fn(response, answer, **row_fields).",
    )
    reward_timeout: float = knob(30.0, "Seconds an async reward call may take; a timeout scores 0.", gt=0.0)
    system_prompt: str = knob("", "System message put before every prompt; empty for none.")
    truncate_prompts: bool = knob(
        False,
        "A prompt longer than the model's context minus rollout.max_tokens: false refuses the run before it starts, "
        "true keeps its last tokens.",
    )
    max_reward_error_frac: float = knob(
        0.5, "Stop the run when more than this fraction of a step's samples raised in the reward function.", min=0.0
    )


@dataclass(frozen=True)
class EnvConfig:
    name: str = knob(
        "",
        "Multi-turn episodes: a built-in environment (retry, lookup, python) or pkg.module:fn, called as "
        "fn(example, tokenizer, "
        "config, prompt_ids, stop) for each prompt's EnvGroupBuilder (mint.envs); the environment gives the rewards. "
        "Empty: one response per prompt, scored by data.reward.",
    )
    max_turns: int = knob(4, "Actions per episode; rollout.max_tokens bounds each one.", min=1)
    max_tokens: int = knob(
        64,
        "Tokens per episode after the prompt, actions and observations together: the longest tail the learner "
        "replays, so LongStraw's memory bound follows from it.",
        min=1,
    )
    step_timeout: float = knob(30.0, "Seconds one environment step may take; past it the episode ends.", gt=0.0)


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = knob(
        8, "G: responses sampled per prompt; advantages are relative within the group.", min=2, max=1024
    )
    prompts_per_step: int = knob(8, "Prompts (groups) per optimizer step.", min=1)
    max_tokens: int = knob(8, "Most tokens generated per response.", min=1)
    temperature: float = knob(
        1.0, "Sampling temperature; the learner scores tokens at the same temperature.", gt=0.0, max=10.0
    )
    top_p: float = knob(1.0, "Nucleus sampling mass; 1.0 samples from the whole distribution.", gt=0.0, max=1.0)
    stop_tokens: list[str] = knob(
        [],
        "Extra tokens that end a response (the model's end-of-turn token always does). "
        "Each must be a single token of the tokenizer.",
    )
    num_actors: int = knob(1, "Rollout actors; prompts are spread across them.", min=1)
    max_restarts: int = knob(
        3, "Times Ray restarts a dead rollout actor (it reloads the current revision and redoes its shard).", min=0
    )
    max_staleness: int = knob(
        0,
        "Overlap: rollout of steps t+1..t+k runs while the learner trains on step t, so a sample is at most k "
        "revisions old; the PPO ratio is then taken against the rollout's logprobs and IcePop masks the tokens that "
        "drifted. 0: on-policy (rollout, then learn). The overlap drains at every checkpoint.every step "
        "(docs/reliability.md).",
        min=0,
    )
    backend: Literal["builtin", "vllm", "sglang"] = knob(
        "builtin",
        "Where responses are sampled: builtin (the exact in-process engine; CPU and CI), vllm (servers speaking "
        "vLLM's OpenAI API: vLLM, or `mint serve`), sglang (SGLang's /generate). See docs/rollout.md.",
    )


@dataclass(frozen=True)
class EnginesConfig:
    """The HTTP engine servers behind rollout.backend = vllm or sglang: listed (urls) or started by the run (start)."""

    urls: list[str] = knob(
        [],
        "Base URLs of engine servers that already run (http://host:port). Rollout actor j fronts "
        "urls[j::rollout.num_actors]; one group's G samples go to one engine (its prefix cache).",
    )
    start: int = knob(
        0,
        "Engine servers the run starts as Ray actors (their URLs replace engines.urls; see docs/rollout.md); "
        "0: use engines.urls, servers that already run.",
        min=0,
    )
    command: str = knob(
        "",
        "engines.start: each server's launch line; {python} {model} {host} {port} {tp} {dtype} {max_lora_rank} "
        "(vllm: lora.rank rounded up to a rank vLLM accepts) {lora_modules} (LoRA's modules, per-expert names "
        "included; several words) {routed_experts} (--enable-return-routed-experts on an MoE base, else nothing) "
        "{cpu_only} (--no-enable-chunked-prefill on an engine without GPUs) {adapter_dir} {index} are filled in. "
        "Empty: the backend's vLLM / SGLang line (docs/rollout.md).",
    )
    path: str = knob(
        "",
        "engines.start: a directory put first on each engine server's PATH, e.g. the bin of a virtualenv that "
        "holds vLLM (`vllm serve` is found there; {python} stays Mint's own); a relative path is taken from where "
        "`mint train` runs. Empty: the PATH as it is.",
    )
    tp: int = knob(1, "engines.start: tensor-parallel size of each (its GPUs, on a run with GPUs).", min=1)
    start_timeout: float = knob(900.0, "engines.start: seconds an engine may take to answer /health.", gt=0.0)
    restarts: int = knob(
        2,
        "engines.start: times the run restarts each engine server it started when it dies (same host and port; "
        "the rollout actors load their revision on it again and the failed rollout or sync is redone). Past that, "
        "or with servers from engines.urls, a dead engine ends the run with one line.",
        min=0,
    )
    request_timeout: float = knob(600.0, "Seconds one engine request may take.", gt=0.0)
    adapter_dir: str = knob(
        "",
        "Where each rollout actor writes the adapter directory its engines load (a path on the actor's node that "
        "the engine can read); empty: <run dir>/engine_adapters.",
    )
    adapter_layout: Literal["auto", "peft", "per-expert"] = knob(
        "auto",
        "The layout of the adapter directory a rollout actor writes. per-expert: fused expert LoRA split per "
        "expert (gate/up/down_proj); peft: as trained (`mint serve` loads both); auto: the layout the backend's "
        "engine reads for the base's family (per-expert for Qwen2/Qwen3-MoE and GLM-4.5 expert LoRA on vLLM and "
        "SGLang), peft without expert LoRA. A layout the engine cannot read is an error (docs/rollout.md).",
    )

    def __post_init__(self):
        engines_rules(self)


@dataclass(frozen=True)
class GrpoConfig:
    steps: int = knob(60, "Optimizer steps in the run.", min=1)
    seed: int = knob(0, "Seed for data order, sampling and LoRA init.", min=0)
    scale_std: bool = knob(True, "Divide advantages by the group's reward std (GRPO); false gives Dr.GRPO.")
    eps_low: float = knob(0.2, "PPO clip below: the ratio is clipped at 1 - eps_low.", min=0.0, max=1.0)
    eps_high: float = knob(0.28, "PPO clip above (clip-higher): the ratio is clipped at 1 + eps_high.", min=0.0)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "constant"] = knob(
        "token-mean",
        "Loss aggregation: token-mean (DAPO), seq-mean-token-mean, or constant "
        "(Dr.GRPO: token sum over groups x rollout.max_tokens).",
    )
    kl_coef: float = knob(
        0.0,
        "Weight of the k3 KL to the reference (the base with the adapter disabled); 0 skips the reference pass.",
        min=0.0,
    )
    filter_zero_variance: bool = knob(False, "Drop groups whose rewards are all equal: their advantage is 0.")
    r3: bool = knob(
        True,
        "Rollout routing replay: the learner reuses the expert ids the rollout chose; tokens "
        "whose route is missing or unmappable get weight 0 (counted by reason).",
    )
    indexer_replay: bool = knob(
        False,
        "DSA indexer replay (DeepSeek-V3.2, GLM-5; built-in rollout engine): the rollout records each response "
        "token's selected keys per indexer layer and the learner attends to them (index_topk int32 per token and "
        "layer: mint plan states the bytes); the step counts where the learner's own selection differed.",
    )
    icepop: bool = knob(
        True, "IcePop: tokens whose learner/rollout probability ratio leaves [icepop_alpha, icepop_beta] get weight 0."
    )
    icepop_alpha: float = knob(0.5, "Lower edge of the trusted ratio band (inclusive).", gt=0.0, max=1.0)
    icepop_beta: float = knob(5.0, "Upper edge of the trusted ratio band (inclusive).", min=1.0)
    tis_cap: float = knob(
        0.0,
        "Truncated importance sampling (0: off): weight each kept token by min(learner/rollout ratio, tis_cap).",
        min=0.0,
    )
    min_kept_fraction: float = knob(0.2, "Stop when the trust mask keeps less of a step's tokens.", min=0.0, max=1.0)
    min_kept_patience: int = knob(3, "Steps in a row under grpo.min_kept_fraction (0: off) that stop the run.", min=1)


@dataclass(frozen=True)
class LearnerConfig:
    num_ranks: int = knob(2, "Learner actors forming one torch.distributed group (gloo on CPU, nccl on GPU).", min=1)
    zero_stage: int = knob(
        1,
        "DeepSpeed ZeRO stage: 1 shards the optimizer state; 2 also the gradients (naive inner step only across "
        "ranks: it reduces inside every backward); 3 also the frozen base (naive inner step only).",
        min=0,
        max=3,
    )
    lr: float = knob(5e-3, "AdamW learning rate for the LoRA parameters.", gt=0.0, max=1.0)
    lr_schedule: Literal["constant", "cosine"] = knob(
        "constant",
        "After warmup: constant, or cosine down to lr x min_lr_ratio at grpo.steps.",
    )
    warmup_steps: int = knob(0, "Steps of linear warmup from 0 to learner.lr.", min=0)
    min_lr_ratio: float = knob(0.1, "cosine: the final learning rate as a fraction of learner.lr.", min=0.0, max=1.0)
    weight_decay: float = knob(0.0, "AdamW weight decay.", min=0.0)
    grad_clip: float = knob(1.0, "Global gradient-norm clip; 0 disables.", min=0.0)
    epochs: int = knob(
        1, "Passes over each step's rollouts (PPO epochs); above 1 the clip starts to matter.", min=1, max=16
    )
    inner_step: Literal["longstraw", "naive"] = knob(
        "longstraw",
        "The learner's inner step: longstraw (prompt captured once, responses replayed in micro-batches sized by "
        "longstraw.replay_budget_mb, memory bounded by the largest micro-batch) or naive (one padded "
        "full-sequence forward per group).",
    )
    expert_parallel: int = knob(
        1,
        "EP: ranks that split the routed experts among them (each holds E/EP experts and their LoRA; tokens travel "
        "to their experts by all-to-all); it divides learner.num_ranks and the expert count, and the groups of EP "
        "ranks are data-parallel replicas of each other. Needs learner.zero_stage = 1. See docs/sharding.md.",
        min=1,
    )

    def __post_init__(self):
        learner_rules(self)


@dataclass(frozen=True)
class LongStrawConfig:
    mode: Literal["exact", "detached", "resident"] = knob(
        "exact",
        "exact: the gradient equals full-sequence backprop; detached: the prompt's K/V are "
        "constants (response-only objective, no prompt backward); resident: detached with the prompt "
        "capture kept across steps for a recurring prompt (stale by design). See docs/longstraw.md.",
    )
    chunk_size: int = knob(
        1024, "Prompt positions per capture chunk (and per prompt-backward chunk in exact mode).", min=1
    )
    max_prefix_age: int = knob(
        0, "resident: recapture a prompt once its capture has served this many steps; 0 never recaptures.", min=0
    )
    checkpoint_min_tokens: int = knob(
        256,
        "Checkpoint each decoder layer in replays and prompt-backward chunks of at least this many tokens (0: never): "
        "the graph keeps each layer's input, backward recomputes the layer; gradients are unchanged.",
        min=0,
    )
    replay_budget_mb: float = knob(
        0.0,
        "MiB that one replay micro-batch may save for backward, by the adapter's estimate: a group's responses are "
        "replayed together (padded to the longest, one forward and one backward) while their micro-batch fits. "
        "0, or less than one response needs, replays one response at a time. It bounds LongStraw's live memory in "
        "place of the longest response's graph (docs/longstraw.md). Context parallel replays one at a time.",
        min=0.0,
    )
    kernels: Literal["auto", "on", "off"] = knob(
        "auto",
        "Which implementation of LongStraw's kernels (prefix attention, fused frozen-head logprob) runs: auto "
        "is Triton on CUDA and their torch reference on CPU; on forces Triton, off the reference.",
    )
    context_parallel: int = knob(
        1,
        "CP: learner ranks that split one prompt's captured K/V pages among them (each keeps ~1/CP of the prefix; "
        "attention over it merges per-rank partials). The CP ranks of a group run the same prompt groups, which "
        "leaves learner.num_ranks / CP data-parallel replicas. CP x learner.expert_parallel divides "
        "learner.num_ranks; learner.inner_step = longstraw in exact or detached mode only. See docs/sharding.md.",
        min=1,
    )


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    longstraw: LongStrawConfig = field(default_factory=LongStrawConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        section_rules(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """sha256 of the canonical JSON of the whole config: the recipe hash recorded with each revision."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def result_digest(self) -> str:
        """sha256 of the keys that can change what a run computes: every key except RESULT_NEUTRAL ones (how long
        it runs, where and how it logs and checkpoints). `--resume` refuses a recipe whose result digest differs."""
        tree = self.to_dict()
        neutral = list(RESULT_NEUTRAL)
        if self.learner.lr_schedule != "constant":  # a cosine's length is grpo.steps: it changes every step's lr
            neutral.remove("grpo.steps")
        for key in neutral:
            section, _, name = key.partition(".")
            if name == "*":
                tree.pop(section, None)
            else:
                tree[section].pop(name, None)
        if self.rollout.max_staleness:  # the overlap drains at checkpoint steps: they decide which revision samples
            tree["checkpoint"] = {"every": self.checkpoint.every}
        return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()


# Keys a resumed run may change: they decide how long a run goes and where it writes, never what a step computes.
RESULT_NEUTRAL = (
    "grpo.steps",
    "grpo.min_kept_fraction",
    "grpo.min_kept_patience",
    "logging.*",
    "checkpoint.*",
    "eval.*",
    "catalog.export_every",
    "catalog.keep_last",
    "ray.address",
    "ray.placement",
    "ray.colocate",
    "engines.urls",  # where the engines run, not what they compute
    "engines.request_timeout",
    "engines.adapter_dir",
    "engines.start",  # the engines' count, launch line and start timeout: where they run, as engines.urls
    "engines.command",
    "engines.path",
    "engines.start_timeout",
    "engines.restarts",
)


# Keys that moved, old -> new: a recipe or override that still names one is refused in one line naming the new key.
RENAMED = {
    "learner.engine": "learner.inner_step",
    "rollout.urls": "engines.urls",
    "rollout.engines": "engines.start",
    "rollout.engine_command": "engines.command",
    "rollout.engine_path": "engines.path",
    "rollout.engine_tp": "engines.tp",
    "rollout.engine_start_timeout": "engines.start_timeout",
    "rollout.engine_restarts": "engines.restarts",
    "rollout.engine_timeout": "engines.request_timeout",
    "rollout.adapter_dir": "engines.adapter_dir",
    "rollout.adapter_layout": "engines.adapter_layout",
    "mint.catalog": "catalog.path",
    "mint.save_every": "catalog.export_every",
    "mint.keep_last": "catalog.keep_last",
    "mint.rollout_records": "catalog.rollout_records",
}


def choices(tp) -> tuple[str, ...] | None:
    """The values a `Literal[...]` annotation allows; None for any other type."""
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def all_keys() -> list[str]:
    """Every dotted key, in declaration order."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
