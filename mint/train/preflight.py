"""Preflight: every check that needs a recipe's inputs, run before the run directory is touched or Ray starts.

`mint.config` checks a recipe's keys on their own; this module opens what they point at: the model directory (its
config.json, read as JSON, never the weights), the tokenizer, the dataset and the eval set, the reward function,
the stop tokens and the catalog path; it checks what the actors would refuse at start (expert parallel against the
base's experts, the adapter layout the engines read, fp16 on a CPU learner); it checks the launch line of the
engine servers the run starts (`engines.start`) against what vLLM or SGLang accept (a LoRA rank, LoRA module
names); and with R3 on an MoE base it asks each engine that already runs (`engines.urls`) for one routed sample.
The first problem raises `ConfigError` with one line that names the key and the fix, so a run that would fail
after Ray started (20-25 s), or train on prompts longer than the model's context, fails before it starts. The
actors' own checks of the same things call the functions here (`check_expert_parallel`, `engine_adapter_layout`,
`check_prompt_lengths`): one implementation.

The checks run cheapest first. Those that need only the standard library (the engines' launch line, a local model
directory, the reward, the dataset, one reward call) take about a millisecond and come before the tokenizer, whose
imports (torch and transformers, through the rollout actor's prompt rendering and the tiny bases) took 2.6 s cold on
2 busy cores. Once imported, a tiny recipe's whole preflight takes about 5 ms.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mint.config import Config, response_room
from mint.errors import ConfigError, DataError, MintError, RewardError
from mint.rl.data import Dataset, FileDataset, eval_examples, load_dataset
from mint.rl.reward_set import RewardSet
from mint.rl.tasks import Example
from mint.train.engine_launch import check_launch

# Synthetic tasks are endless: the first batches of the run's own stream stand for the rest.
SYNTHETIC_BATCHES = 4
# A model directory needs one of these for AutoTokenizer to find a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# A hub id (`org/name`, `name`) or `tiny:<family>`. Any other spec that does not exist is a missing path.
_NAMED = re.compile(r"[A-Za-z0-9][\w.-]*([/:][\w.-]+)?")


@dataclass(frozen=True)
class Preflight:
    """What preflight found, for the stages after it. Plain values: it pickles and crosses Ray."""

    model_path: str  # the local model directory; for a tiny:<family> base not built yet, the spec itself
    tiny_family: str | None  # the family of a tiny:<family> base, else None
    max_positions: int  # the model's max_position_embeddings
    vocab_size: int  # the model's vocab_size
    prompts_checked: int  # every record of a file dataset; SYNTHETIC_BATCHES batches of a synthetic task
    longest_prompt: int  # tokens of the longest checked prompt, chat template (and system prompt) included
    prompts_over_limit: int  # checked prompts longer than max_positions - rollout.max_tokens (kept when truncating)
    seconds: float  # wall time of the whole preflight


@dataclass(frozen=True)
class _Model:
    path: str
    tiny_family: str | None
    max_positions: int
    vocab_size: int
    tokenizer: Any = field(default=None, compare=False)  # set when built in memory (a tiny base not built yet)
    config: Any = field(default=None, compare=False)  # its transformers config, likewise


def preflight(config: Config) -> Preflight:
    """Check the engines' launch line, model, reward, dataset, tokenizer, stop tokens and prompt lengths of `config`.

    Order: the engines' launch line, catalog.path, a local model directory, the reward's import, the dataset and the
    eval set, one reward call; then (after the heavy imports) fp16 on a CPU learner, a tiny or hub model, the
    tokenizer, the stop tokens, expert parallel against the base's experts, R3's routers, DSA indexer replay's base
    and engines, the base and adapter layout a vllm/sglang engine is handed, and the length of every training and
    eval prompt; last, with grpo.r3 on an MoE base, that every engine of engines.urls sends expert routes back (one
    sample of one token each). Raises ConfigError (one line, naming the key) on the first problem. Starts nothing
    and writes nothing: no Ray, no run directory, no tiny base build (a tiny base not yet cached is checked with its
    tokenizer and config, built in memory).
    """
    start = time.perf_counter()
    if config.engines.start:
        check_launch(config)  # values vLLM / SGLang would refuse when the run starts them, minutes from now
    _catalog(config)
    local = _local_model(config.model.path)
    rewards = _reward(config)
    dataset = _dataset(config)
    examples = _examples(dataset, config)
    held_out, eval_stream = _eval_examples(config)
    _call_reward(rewards, examples[0])
    # From here on torch and transformers are imported (the tokenizer, and the rollout actor's prompt rendering).
    from mint.envs.registry import check_environment
    from mint.models.quant_checkpoint import resolve_quantization
    from mint.rollout.prompts import prompt_tokens, stop_token_ids

    check_fp16(config)
    model = local or _named_model(config.model.path)
    resolve_quantization(config.model.quantization, model.path)
    tokenizer = model.tokenizer or _tokenizer(model.path)
    if len(tokenizer) > model.vocab_size:
        raise ConfigError(
            f"model.path: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model.vocab_size}; "
            "they do not belong together"
        )
    stop_token_ids(tokenizer, config.rollout.stop_tokens)
    if config.env.name:  # the environment loads, and the chat template renders observations as deltas
        check_environment(config.env.name, tokenizer)
    if config.learner.expert_parallel > 1:
        check_expert_parallel(config, _model_config(model))
    if config.grpo.r3:
        check_route_replay(_model_config(model))
    if config.grpo.indexer_replay:
        check_indexer_replay(config, _model_config(model))
    # As the rollout actor will: auto too, since an engine refuses some bases (vLLM on kimi_k25) and some targets
    # (kv_b_proj on MLA in vLLM) whatever the layout.
    if config.rollout.backend != "builtin":
        model_config = _model_config(model)
        # The meta-device skeleton the layout is read off warns (a transformers FutureWarning): a second stderr line.
        with warnings.catch_warnings(), _quiet("transformers"), _quiet("peft"):
            warnings.simplefilter("ignore")
            engine_adapter_layout(config, model_config, engine_adapter_config(config, model_config, model.path))
    key, room = response_room(config)
    limit = model.max_positions - room  # most prompt tokens that leave room for a response (an episode's tail)
    if limit < 1:
        raise ConfigError(
            f"{key}: {room} leaves no room for a prompt in the model's {model.max_positions} positions; lower it"
        )
    with _quiet("transformers"):  # its "sequence length is longer than" warning would be a second stderr line
        rendered = [prompt_tokens(tokenizer, ex, config.data.system_prompt) for ex in examples]
        eval_lengths = [len(prompt_tokens(tokenizer, ex, config.data.system_prompt)) for ex in held_out]
    lengths = [len(tokens) for tokens in rendered]
    stream = not isinstance(dataset, FileDataset)
    over = check_prompt_lengths("data.source", lengths, limit, config, _which(stream))
    if held_out:  # sampled on the same actors with the same rollout.max_tokens
        check_prompt_lengths("eval.source", eval_lengths, limit, config, _which(eval_stream))
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if config.grpo.r3 and config.engines.urls and config.rollout.backend in ("vllm", "sglang"):
        # Last: the one check that talks to another process (one short request per engine).
        check_engine_routes(config, _model_config(model), min(rendered, key=len)[-limit:])
    return Preflight(
        model_path=model.path,
        tiny_family=model.tiny_family,
        max_positions=model.max_positions,
        vocab_size=model.vocab_size,
        prompts_checked=len(lengths),
        longest_prompt=lengths[longest],
        prompts_over_limit=over,
        seconds=time.perf_counter() - start,
    )


def check_prompt_lengths(
    key: str, lengths: list[int], limit: int, config: Config, which: Callable[[int], str] = lambda i: "a prompt"
) -> int:
    """How many of `lengths` (prompt tokens, chat template included) are over `limit`, the tokens that leave room for
    rollout.max_tokens in the model's positions; ConfigError naming `key` and the longest one (`which(index)`) when
    any is and data.truncate_prompts is off. Preflight runs it over every checked prompt, the rollout actor over
    each prompt it samples (a synthetic stream's later draws were not checked)."""
    over = sum(n > limit for n in lengths)
    if over and not config.data.truncate_prompts:
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        count = f" ({over} of {len(lengths)} prompts checked are over)" if len(lengths) > 1 else ""
        raise ConfigError(
            f"{key}: {which(longest)} is {lengths[longest]} tokens with the chat template, over the {limit} that fit "
            f"the model's {limit + config.rollout.max_tokens} positions with rollout.max_tokens="
            f"{config.rollout.max_tokens}{count}; shorten the prompts, lower rollout.max_tokens, "
            "or set data.truncate_prompts=true"
        )
    return over


def check_expert_parallel(config: Config, model_config) -> None:
    """What learner.expert_parallel > 1 needs of the base and the inner step: routed experts that EP divides, and
    not LongStraw's resident mode. The learner checks it again when it loads the base."""
    from mint.models.specs import VLM_TEXT_KEY_MAPPINGS, moe_layout

    ep = config.learner.expert_parallel
    if (model_type := getattr(model_config, "model_type", "")) in VLM_TEXT_KEY_MAPPINGS:
        # mint.models.expert_parallel builds its skeleton from the checkpoint's config and reads its keys unrenamed
        raise ConfigError(f"learner.expert_parallel: the expert-parallel loader does not read {model_type} yet; use 1")
    layout = moe_layout(model_config)
    if layout is None or layout.num_experts % ep:
        what = f"{layout.num_experts} routed experts" if layout else "no routed experts"
        raise ConfigError(f"learner.expert_parallel: {ep} does not divide the base's experts ({what}); use 1")
    if config.learner.inner_step == "longstraw" and config.longstraw.mode == "resident":
        raise ConfigError(
            "learner.expert_parallel: resident mode is not supported with expert parallel (each rank's kept "
            "captures differ, so their MoE calls would not pair up); use longstraw.mode = exact or detached"
        )


def engine_adapter_config(config: Config, model_config, model_path: str) -> dict:
    """adapter_config.json as the learner's PEFT model writes it (`adapter_config_dict`), from the same recipe: what
    a vllm/sglang rollout actor hands its engines with each revision."""
    from mint.models.lora import peft_config

    lora = peft_config(config.lora, model_config).to_dict()
    lora["base_model_name_or_path"] = model_path
    return {k: sorted(v) if isinstance(v, set) else v for k, v in lora.items()}


def engine_adapter_layout(config: Config, model_config, adapter_config: dict) -> str:
    """The adapter layout (peft or per-expert) a vllm/sglang rollout actor writes for its engines
    (`mint.hub.engine_layout` of engines.adapter_layout); ConfigError when the engine cannot read the one asked for,
    or takes no LoRA on the base at all (the family registry's `engine_refusal`: then the key is rollout.backend)."""
    from mint.hub import engine_layout
    from mint.models.families import engine_refusal

    if refused := engine_refusal(config.rollout.backend, getattr(model_config, "model_type", "")):
        raise ConfigError(f"rollout.backend: {refused}")
    try:
        return engine_layout(config.engines.adapter_layout, adapter_config, model_config, config.rollout.backend)
    except MintError as err:
        raise ConfigError(f"engines.adapter_layout: {err}") from None


def check_indexer_replay(config: Config, model_config) -> None:
    """grpo.indexer_replay needs a DSA base (an index_topk), the built-in rollout engine (the one that records the
    indexer's selections) and LongStraw (the inner step that replays them)."""
    from mint.models.specs import text_config

    if getattr(text_config(model_config), "index_topk", None) is None:
        what = getattr(model_config, "model_type", "this base")
        raise ConfigError(f"grpo.indexer_replay: {what} has no DSA indexer to replay; set it false")
    if config.rollout.backend != "builtin":
        raise ConfigError(
            f"grpo.indexer_replay: the {config.rollout.backend} backend returns no indexer selections; only the "
            "builtin engine records them"
        )
    if config.learner.inner_step != "longstraw":
        raise ConfigError("grpo.indexer_replay: only the longstraw inner step replays indexer selections")


def check_route_replay(model_config) -> None:
    """R3 recomputes each replayed route's weights by its router's own rule: a base whose router class has none
    (`longstraw.routing.ROUTER_RULES`) is refused here, read off a meta-device skeleton (no weights). A dense base
    has no routers and nothing to replay."""
    import torch
    from transformers import AutoModelForCausalLM

    from longstraw.errors import LongStrawError
    from longstraw.routing import check_replayable, find_routers
    from mint.models.specs import causal_lm_config, moe_layout

    if moe_layout(model_config) is None:
        return
    with torch.device("meta"), warnings.catch_warnings(), _quiet("transformers"):
        warnings.simplefilter("ignore")
        skeleton = AutoModelForCausalLM.from_config(causal_lm_config(model_config))  # a VLM's: its text model
    try:
        check_replayable(find_routers(skeleton))
    except LongStrawError as err:
        raise ConfigError(f"grpo.r3: {err}") from None


def check_engine_routes(config: Config, model_config, prompt: list[int]) -> None:
    """grpo.r3 on an MoE base with engines that already run (engines.urls): ask each engine for one sample of one
    token of `prompt` and refuse, in one line naming the engine and the fix, when it sends no expert routes back (a
    vLLM or SGLang server started without --enable-return-routed-experts) or routes that do not fit the base. Either
    way every response token of the run would be masked (route_missing, or route_layers and the like) and its LoRA
    gradient would be zero: the run would go to its last step and learn nothing. An engine that is down is refused
    here too (the rollout actors would stop on it at their start). A dense base has nothing to replay."""
    from longstraw.routing import ROUTE_REASONS, route_status
    from mint.models.specs import moe_layout
    from mint.rollout.backends import EngineError, http_backend
    from mint.rollout.engine import SamplingParams

    layout = moe_layout(model_config)
    if layout is None:
        return
    backend_name = config.rollout.backend
    params = SamplingParams(temperature=config.rollout.temperature, max_tokens=1)
    for url in config.engines.urls:
        try:
            backend = http_backend(backend_name, [url], layout, config.engines.request_timeout)
            try:
                group = backend.generate([prompt], 1, params, config.grpo.seed)[0]
            finally:
                backend.close()
        except EngineError as err:
            raise ConfigError(f"engines.urls: {err}") from None
        completion = group.completions[0]
        status = route_status(completion.routes_R_L_K, len(completion.tokens_R), layout)
        if bool((status == 0).any()):
            continue
        reason = ROUTE_REASONS[int(status[0]) - 1]
        if reason == "route_missing":
            raise ConfigError(
                f"grpo.r3: the {backend_name} engine at {url} sent no expert routes with its sample, so every token "
                "would be masked route_missing and the run would learn nothing; start it with "
                "--enable-return-routed-experts, or set grpo.r3=false"
            )
        raise ConfigError(
            f"grpo.r3: the {backend_name} engine at {url} sent expert routes that do not fit {config.model.path} "
            f"({reason}), so every token would be masked and the run would learn nothing; serve that base there, "
            "or set grpo.r3=false"
        )


def cpu_fp16_supported() -> bool:
    """Whether DeepSpeed's CPU accelerator takes fp16 here. Its `is_fp16_supported()` asks oneDNN, which says yes
    only on a CPU with AVX-512-FP16 or AMX-FP16; the learner's `deepspeed.initialize` raises "Type fp16 is not
    supported on your device" otherwise. The same call, made without importing deepspeed (that import picks an
    accelerator, logs a warning line and takes 0.6 s)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # DeepSpeed reads any failure of the probe as unsupported
        return False


def check_fp16(config: Config) -> None:
    """model.dtype = float16 on a learner that runs DeepSpeed's CPU accelerator (no GPU asked for, or a local cluster
    on a machine without CUDA: LearnerActor.use_cuda) needs a CPU with fp16 support."""
    if config.model.dtype != "float16" or not _cpu_learner(config) or cpu_fp16_supported():
        return
    raise ConfigError(
        "model.dtype: float16 on a CPU learner needs fp16 support in the CPU (AVX-512-FP16 or AMX-FP16, as DeepSpeed "
        "asks oneDNN), which this machine lacks; use bfloat16 or float32"
    )


def _cpu_learner(config: Config) -> bool:
    if config.ray.learner_gpus == 0:
        return True
    if config.ray.address:  # the cluster's nodes are not this machine
        return False
    import torch

    return not torch.cuda.is_available()


def _local_model(spec: str) -> _Model | None:
    """The model at `spec` when it is a local directory; None when it is not a path (a tiny or hub spec)."""
    path = Path(spec)  # as from_pretrained reads it: no ~ expansion
    if path.is_dir():
        return _model_dir(path, spec)
    if path.exists():
        raise ConfigError(f"model.path: {spec} is a file; give the model's directory (with config.json)")
    if not _NAMED.fullmatch(spec):
        raise ConfigError(f"model.path: {spec} does not exist")
    return None


def _named_model(spec: str) -> _Model:
    """A `tiny:<family>` base (its cached build, or its config and tokenizer when not built yet), or a hub id that
    is already in the local Hugging Face cache: nothing is downloaded here."""
    from mint.models.specs import TINY_FAMILIES, TINY_PREFIX, tiny_config

    if spec.startswith(TINY_PREFIX):
        family = spec[len(TINY_PREFIX) :]
        if family not in TINY_FAMILIES:
            raise ConfigError(f"model.path: unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
        from mint.models.tiny import TinyRecipe, build_tokenizer, default_cache_dir, is_complete

        # ensure_tiny's folder, looked up without building (a build takes ~20 s and belongs to the run).
        cached = os.path.join(default_cache_dir(), "tiny", f"{family}-{TinyRecipe(family).key()}")
        if is_complete(cached):
            return _model_dir(Path(cached), spec, family)
        tokenizer = build_tokenizer()  # 60 ms; the same tokenizer a build saves
        config = tiny_config(family, vocab_size=len(tokenizer))
        return _Model(spec, family, config.max_position_embeddings, config.vocab_size, tokenizer, config)
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(spec, "config.json")
    except Exception:  # not a valid repo id (a mistyped path): not in the cache either
        found = None
    if not isinstance(found, str):
        raise ConfigError(
            f"model.path: {spec} is not a local directory, nor a hub id in the local Hugging Face cache "
            "(nothing is downloaded here); download the model and give its directory"
        )
    return _model_dir(Path(found).parent, spec)


def _model_dir(path: Path, spec: str, tiny_family: str | None = None) -> _Model:
    """Read `path`/config.json as JSON (the weights are never loaded) and check the tokenizer files are there."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path: {spec} has no config.json; is it a transformers model directory?")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.path: cannot read {config_file}: {_one_line(e)}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"model.path: {config_file} has no model_type; is it a transformers model config?")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model.path: {spec} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    text = config.get("text_config")  # multimodal configs keep the language model's sizes there
    sizes = {**(text if isinstance(text, dict) else {}), **config}
    for key in ("max_position_embeddings", "vocab_size"):
        if not isinstance(sizes.get(key), int) or sizes[key] < 1:
            raise ConfigError(f"model.path: {config_file} has no {key}; cannot check prompt lengths against it")
    return _Model(str(path), tiny_family, sizes["max_position_embeddings"], sizes["vocab_size"])


def _tokenizer(path: str):
    """The tokenizer the rollout actor will load: AutoTokenizer on the model directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a broken tokenizer file fails in many ways
        raise ConfigError(f"model.path: cannot load the tokenizer of {path}: {_one_line(e)}") from None


def _reward(config: Config) -> RewardSet:
    try:
        return RewardSet(config.data.reward, config.data.reward_timeout)
    except RewardError as e:
        raise ConfigError(f"data.reward: {e}") from None


def _dataset(config: Config) -> Dataset:
    d = config.data
    try:
        return load_dataset(d.source, d.prompt_key, d.answer_key)
    except DataError as e:
        raise ConfigError(f"data.source: {e}") from None


def _eval_examples(config: Config) -> tuple[list[Example], bool]:
    """The held-out prompts the run evaluates (mint.rl.data.eval_examples, as the run picks them), and whether they
    are draws of a synthetic stream: eval.source opens and has the fields, and its prompts are checked like the
    training ones."""
    c = config
    try:
        return eval_examples(c.eval.source, c.eval.max_prompts, c.data.prompt_key, c.data.answer_key)
    except DataError as e:
        raise ConfigError(f"eval.source: {e}") from None


def _catalog(config: Config) -> None:
    """catalog.path is a directory, or can be made one: the driver opens it after moving the previous run aside."""
    if not config.catalog.path:
        return  # <run dir>/catalog, made with the run directory
    path = Path(config.catalog.path)
    for at in (path, *path.parents):
        if at.is_dir():
            return
        if at.exists():
            where = "is a file" if at == path else f"cannot be made: {at} is a file"
            raise ConfigError(f"catalog.path: {path} {where}; give a directory (made when missing)")


def _model_config(model: _Model):
    """The base's transformers config (config.json; no weights)."""
    if model.config is not None:
        return model.config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model.path)
    except Exception as e:  # an unknown model_type, a broken field: transformers fails in many ways
        raise ConfigError(f"model.path: cannot read the config of {model.path}: {_one_line(e)}") from None


def _which(stream: bool) -> Callable[[int], str]:
    """How a length error names prompt i: a file's record, or a draw of a synthetic task's stream."""
    return (lambda i: f"sample {i} of the stream") if stream else (lambda i: f"record {i} (0-based)")


def _examples(dataset: Dataset, config: Config) -> list[Example]:
    """Every example of a file dataset; the first SYNTHETIC_BATCHES batches of a synthetic task's stream."""
    if isinstance(dataset, FileDataset):
        return list(dataset.examples)
    return dataset.take(SYNTHETIC_BATCHES * config.rollout.prompts_per_step, config.grpo.seed)


def _call_reward(rewards: RewardSet, example: Example) -> None:
    """Score the first example's own answer as the response once: every function must return a finite number."""
    try:
        with _quiet("mint.rl"):  # the failure is this function's one line; the scorer's own warning would be a second
            rewards.check(example)
    except RewardError as e:
        raise ConfigError(f"data.reward: {e}") from None


@contextlib.contextmanager
def _quiet(name: str):
    """Only errors from logger `name` and its children while inside."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())
