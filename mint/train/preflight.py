"""Preflight: every check that needs a recipe's inputs, run before the run directory is touched or Ray starts.

`mint.config` checks a recipe's keys on their own; this module opens what they point at: the model directory (its
config.json, read as JSON, never the weights), the tokenizer, the dataset, the reward function and the stop
tokens; and it checks the launch line of the engine servers the run starts (`rollout.engines`) against what vLLM or
SGLang accept (a LoRA rank, LoRA module names). The first problem raises `ConfigError` with one line that names the
key and the fix, so a run that would fail after Ray started (20-25 s), or train on prompts longer than the model's
context, fails before it starts.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mint.config import Config
from mint.errors import ConfigError, DataError, RewardError
from mint.rl.data import Dataset, FileDataset, load_dataset
from mint.rl.reward_set import RewardSet
from mint.rl.tasks import Example
from mint.train.engines import check_launch

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


def preflight(config: Config) -> Preflight:
    """Check the engines' launch line, model, reward, dataset, tokenizer, stop tokens and prompt lengths of `config`.

    Order: the engines' launch line, a local model directory, the reward's import, the dataset, one reward call; then
    (after the heavy imports) a tiny or hub model, the tokenizer, the stop tokens, and every prompt's length. Raises
    ConfigError (one line, naming the key) on the first problem. Starts nothing and writes nothing: no Ray, no run
    directory, no tiny base build (a tiny base not yet cached is checked with its tokenizer and config, built in
    memory).
    """
    start = time.perf_counter()
    if config.rollout.engines:
        check_launch(config)  # values vLLM / SGLang would refuse when the run starts them, minutes from now
    local = _local_model(config.model.path)
    rewards = _reward(config)
    dataset = _dataset(config)
    examples = _examples(dataset, config)
    _eval_source(config)
    _call_reward(rewards, examples[0])
    # From here on torch and transformers are imported (the tokenizer, and the rollout actor's prompt rendering).
    from mint.train.rollout_actor import prompt_tokens, stop_token_ids

    model = local or _named_model(config.model.path)
    tokenizer = model.tokenizer or _tokenizer(model.path)
    if len(tokenizer) > model.vocab_size:
        raise ConfigError(
            f"model.path: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model.vocab_size}; "
            "they do not belong together"
        )
    stop_token_ids(tokenizer, config.rollout.stop_tokens)
    limit = model.max_positions - config.rollout.max_tokens  # most prompt tokens that leave room for a response
    if limit < 1:
        raise ConfigError(
            f"rollout.max_tokens: {config.rollout.max_tokens} leaves no room for a prompt in the model's "
            f"{model.max_positions} positions; lower it"
        )
    with _quiet("transformers"):  # its "sequence length is longer than" warning would be a second stderr line
        lengths = [len(prompt_tokens(tokenizer, ex, config.data.system_prompt)) for ex in examples]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    over = sum(n > limit for n in lengths)
    if over and not config.data.truncate_prompts:
        which = f"record {longest} (0-based)" if isinstance(dataset, FileDataset) else f"sample {longest} of the stream"
        raise ConfigError(
            f"data.source: {which} is {lengths[longest]} tokens with the chat template, over the {limit} that fit "
            f"the model's {model.max_positions} positions with rollout.max_tokens={config.rollout.max_tokens} "
            f"({over} of {len(lengths)} prompts checked are over); shorten the prompts, lower rollout.max_tokens, "
            "or set data.truncate_prompts=true"
        )
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
        return _Model(spec, family, config.max_position_embeddings, config.vocab_size, tokenizer)
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


def _eval_source(config: Config) -> None:
    """eval.source opens and has the fields (held-out prompts are checked like the training ones)."""
    if config.eval.source:
        try:
            load_dataset(config.eval.source, config.data.prompt_key, config.data.answer_key)
        except DataError as e:
            raise ConfigError(f"eval.source: {e}") from None


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
