"""Recipes: TOML files loaded into frozen dataclasses, with dotted `key=value` overrides.

Every field has a default and a help string, and is validated at load. A bad recipe or override raises `ConfigError`
with one line that names the dotted key (and the closest valid key when there is one); the CLI prints that line and
exits with code 2. Nothing rewrites a config in place: derived values come from pure functions below.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mint.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def knob(default: Any, help: str, *, min: float | None = None, max: float | None = None, choices=None, gt=None):
    """A config field: default, help string, and the range or choices validated at load."""
    meta = {"help": help, "min": min, "max": max, "gt": gt, "choices": tuple(choices) if choices else None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    path: str = knob(
        "tiny:qwen3_moe",
        "Base model: a hub id, a local directory, or tiny:qwen3_moe / tiny:qwen2_moe "
        "for the embedded tiny bases (built locally and cached, never downloaded).",
    )
    dtype: str = knob(
        "float32", "Dtype of the frozen base and the LoRA weights.", choices=("float32", "bfloat16", "float16")
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


@dataclass(frozen=True)
class DataConfig:
    source: str = knob(
        "synthetic:first_last",
        "Prompts: synthetic:<task> for a built-in task, or a .jsonl / .parquet file with prompt and answer fields.",
    )
    prompt_key: str = knob("prompt", "Field holding the prompt (the user message) in a file dataset.")
    answer_key: str = knob("answer", "Field holding the reference answer in a file dataset.")
    reward: str = knob("exact_match", "Reward function: a built-in name (exact_match, math) or pkg.module:fn.")
    system_prompt: str = knob("", "System message put before every prompt; empty for none.")


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


@dataclass(frozen=True)
class GrpoConfig:
    steps: int = knob(60, "Optimizer steps in the run.", min=1)
    seed: int = knob(0, "Seed for data order, sampling and LoRA init.", min=0)
    scale_std: bool = knob(True, "Divide advantages by the group's reward std (GRPO); false gives Dr.GRPO.")
    eps_low: float = knob(0.2, "PPO clip below: the ratio is clipped at 1 - eps_low.", min=0.0, max=1.0)
    eps_high: float = knob(0.28, "PPO clip above (clip-higher): the ratio is clipped at 1 + eps_high.", min=0.0)
    loss_agg: str = knob(
        "token-mean",
        "Loss aggregation: token-mean (DAPO), seq-mean-token-mean, or constant "
        "(Dr.GRPO: token sum over groups x rollout.max_tokens).",
        choices=("token-mean", "seq-mean-token-mean", "constant"),
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
    icepop: bool = knob(
        True, "IcePop: tokens whose learner/rollout probability ratio leaves [icepop_alpha, icepop_beta] get weight 0."
    )
    icepop_alpha: float = knob(0.5, "Lower edge of the trusted ratio band (inclusive).", gt=0.0, max=1.0)
    icepop_beta: float = knob(5.0, "Upper edge of the trusted ratio band (inclusive).", min=1.0)


@dataclass(frozen=True)
class LearnerConfig:
    num_ranks: int = knob(2, "Learner actors forming one torch.distributed group (gloo on CPU, nccl on GPU).", min=1)
    zero_stage: int = knob(
        1,
        "DeepSpeed ZeRO stage: 1 shards the optimizer state; 2 also the gradients (naive engine only across ranks: it "
        "reduces inside every backward); 3 also the frozen base (naive engine only).",
        min=0,
        max=3,
    )
    lr: float = knob(5e-3, "AdamW learning rate for the LoRA parameters.", gt=0.0)
    weight_decay: float = knob(0.0, "AdamW weight decay.", min=0.0)
    grad_clip: float = knob(1.0, "Global gradient-norm clip; 0 disables.", min=0.0)
    epochs: int = knob(
        1, "Passes over each step's rollouts (PPO epochs); above 1 the clip starts to matter.", min=1, max=16
    )
    engine: str = knob(
        "longstraw",
        "Inner step: longstraw (prompt captured once, responses replayed one at a time, "
        "memory bounded by the longest response) or naive (one padded full-sequence forward per "
        "group).",
        choices=("longstraw", "naive"),
    )


@dataclass(frozen=True)
class LongStrawConfig:
    mode: str = knob(
        "exact",
        "exact: the gradient equals full-sequence backprop; detached: the prompt's K/V are "
        "constants (response-only objective, no prompt backward); resident: detached with the prompt "
        "capture kept across steps for a recurring prompt (stale by design). See docs/longstraw.md.",
        choices=("exact", "detached", "resident"),
    )
    chunk_size: int = knob(
        1024, "Prompt positions per capture chunk (and per prompt-backward chunk in exact mode).", min=1
    )
    max_prefix_age: int = knob(
        0, "resident: recapture a prompt once its capture has served this many steps; 0 never recaptures.", min=0
    )
    kernels: str = knob(
        "auto",
        "Which implementation of LongStraw's kernels (prefix attention, fused frozen-head logprob) runs: auto "
        "is Triton on CUDA and their torch reference on CPU; on forces Triton, off the reference.",
        choices=("auto", "on", "off"),
    )


@dataclass(frozen=True)
class RayConfig:
    address: str = knob("", "Ray cluster to join (e.g. auto or ray://host:10001); empty starts a local one.")
    learner_cpus: float = knob(1.0, "CPUs reserved per learner rank.", gt=0.0)
    learner_gpus: float = knob(0.0, "GPUs per learner rank; 0 runs the learner on CPU.", min=0.0)
    rollout_cpus: float = knob(1.0, "CPUs reserved per rollout actor.", gt=0.0)
    rollout_gpus: float = knob(0.0, "GPUs per rollout actor.", min=0.0)
    torch_threads: int = knob(1, "torch threads per actor; keep actors x threads <= cores.", min=1)
    placement: str = knob(
        "PACK", "Placement-group strategy for the actors.", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
    )


@dataclass(frozen=True)
class LoggingConfig:
    name: str = knob("mint", "Run name; the run directory is <root>/<name>.")
    root: str = knob("runs", "Folder that holds run directories.")
    wandb: bool = knob(False, "Log to Weights & Biases (offline unless WANDB_API_KEY or WANDB_MODE says otherwise).")
    wandb_project: str = knob("mint", "wandb project name.")
    progress: bool = knob(True, "Show a progress bar on stderr.")


@dataclass(frozen=True)
class MintConfig:
    catalog: str = knob(
        "",
        "Revision catalog the run publishes every step's revision to (several runs may share one); "
        "empty means <run dir>/catalog.",
    )
    save_every: int = knob(
        1,
        "Also export the revision as a PEFT adapter directory in <run dir>/adapters every N steps "
        "(the last step always).",
        min=1,
    )
    keep_last: int = knob(
        0,
        "Retention: revisions of this run whose tensors stay in the catalog (the N latest, plus tagged and named "
        "ones; entries and lineage always stay), and adapter directories kept in <run dir>/adapters. 0 keeps all.",
        min=0,
    )
    rollout_records: str = knob(
        "full",
        "Rollout records kept per step in the catalog (tokens, logprobs, rewards, linked to the sampling revision): "
        "full (with R3 routes), no_routes, or off.",
        choices=("full", "no_routes", "off"),
    )


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    longstraw: LongStrawConfig = field(default_factory=LongStrawConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    mint: MintConfig = field(default_factory=MintConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """sha256 of the canonical JSON of the whole config: the recipe hash recorded with each revision."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def all_keys() -> list[str]:
    """Every dotted key, in declaration order."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" (did you mean {match[0]}?)" if match else ""


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, "a list of strings")


def _check_value(key: str, tp, meta: dict, value: Any) -> Any:
    """Type- and range-check one value; returns it converted (int -> float where a float is expected)."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typing.get_origin(tp) is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    elif not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, meta['choices']))}")
    if meta["min"] is not None and value < meta["min"]:
        raise ConfigError(f"{key}: {value!r} is below the minimum {meta['min']}")
    if meta["max"] is not None and value > meta["max"]:
        raise ConfigError(f"{key}: {value!r} is above the maximum {meta['max']}")
    if meta["gt"] is not None and value <= meta["gt"]:
        raise ConfigError(f"{key}: {value!r} must be greater than {meta['gt']}")
    return value


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{section}.{name}"
        if name not in fields:
            raise ConfigError(f"{key}: unknown key{_closest(key, all_keys())}")
        kwargs[name] = _check_value(key, hints[name], fields[name].metadata, value)
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[str, str]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{item}: an override must look like section.key=value")
    return key.strip(), raw.strip()


def _override_value(key: str, raw: str) -> Any:
    """Parse an override's value as TOML (1, 0.5, true, ["a"]), falling back to the raw text for strings."""
    section, _, name = key.partition(".")
    tp = typing.get_type_hints(SECTIONS[section]).get(name)
    if tp is str and not raw.startswith(('"', "'")):
        return raw  # a path or hub id needs no quotes on the command line
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def build_config(tree: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Validate a parsed recipe plus dotted overrides into a Config. Raises ConfigError naming the key."""
    merged: dict[str, dict[str, Any]] = {}
    for section, values in tree.items():
        if section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section{_closest(section, list(SECTIONS))}")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {values!r}")
        merged[section] = dict(values)
    for item in overrides:
        key, raw = _parse_override(item)
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise ConfigError(f"{key}: unknown key{_closest(key, all_keys())}")
        merged.setdefault(section, {})[name] = _override_value(key, raw) if name in _field_names(section) else raw
    config = Config(**{s: _build_section(s, SECTIONS[s], merged.get(s, {})) for s in SECTIONS})
    check_consistency(config)
    return config


def _field_names(section: str) -> set[str]:
    return {f.name for f in dataclasses.fields(SECTIONS[section])}


def check_consistency(config: Config) -> None:
    """Rules that involve more than one key."""
    if config.learner.engine == "longstraw" and config.learner.zero_stage == 3:
        raise ConfigError(
            "learner.engine: longstraw runs the model piecewise and needs whole weights on each rank; "
            "use learner.zero_stage = 1 or learner.engine = naive"
        )
    if config.learner.engine == "longstraw" and config.learner.zero_stage == 2 and config.learner.num_ranks > 1:
        # ZeRO-2 reduces gradients inside every backward call; LongStraw makes one call per response and per prompt
        # chunk, so ranks whose prompts differ in length issue different collectives (gloo aborts, NCCL hangs).
        # Stage 1 reduces once, at the accumulation boundary. Issue 9.
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


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Load a TOML recipe and apply `section.key=value` overrides."""
    path = Path(path)
    try:
        tree = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return build_config(tree, overrides)


def run_dir(config: Config) -> Path:
    """Where a run writes metrics, adapters and the resolved config."""
    return Path(config.logging.root) / config.logging.name


def norm_constant(config: Config) -> int:
    """Dr.GRPO's constant normalizer per response: the most tokens a response may have."""
    return config.rollout.max_tokens


def config_markdown() -> str:
    """docs/configuration.md, generated from the dataclasses (a test keeps the file in sync)."""
    lines = [
        "# Configuration",
        "",
        "Recipes are TOML files with one table per section. Any key can be overridden on the command line with a",
        "dotted `section.key=value` (values parse as TOML; strings need no quotes). An unknown key, a wrong type or a",
        "value out of range stops the run with one line naming the key, and exit code 2.",
        "",
        "This page is generated from `mint/config.py` by `python -m mint.config > docs/configuration.md`;",
        "a test fails when they drift apart.",
        "",
    ]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        lines += [f"## [{section}]", "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(
                f"| `{section}.{f.name}` | {_short_type(hints[f.name])} | `{json.dumps(default)}` "
                f"| {_allowed(f.metadata)} | {f.metadata['help']} |"
            )
        lines.append("")
    return "\n".join(lines)


def _short_type(tp) -> str:
    return tp.__name__ if isinstance(tp, type) and not isinstance(tp, types.GenericAlias) else "list[str]"


def _allowed(meta: dict) -> str:
    if meta["choices"]:
        return ", ".join(f"`{c}`" for c in meta["choices"])
    parts = []
    if meta["gt"] is not None:
        parts.append(f"> {meta['gt']}")
    if meta["min"] is not None:
        parts.append(f">= {meta['min']}")
    if meta["max"] is not None:
        parts.append(f"<= {meta['max']}")
    return ", ".join(parts) or "any"


if __name__ == "__main__":
    print(config_markdown())
