"""RolloutActor: samples G responses per prompt with the built-in engine and scores them with the reward function.

It holds the frozen base plus a LoRA adapter of the same shape as the learner's. Weight sync is a revision
publish: the driver hands it the adapter's safetensors bytes (through the object store) and the revision id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mint.config import Config
from mint.errors import ConfigError, MintError
from mint.rl.tasks import Example
from mint.rollout.engine import GroupRollout, SamplingParams


class StaleRevision(MintError):
    """The actor does not hold the revision the driver asked to sample with (it was restarted by Ray since)."""


@dataclass(frozen=True)
class GroupResult:
    """One prompt's rollout plus its rewards, and which adapter revision produced it."""

    example: Example
    rollout: GroupRollout
    responses: list[str]
    rewards_G: list[float]
    reward_errors: int
    revision: str | None
    reward_error: str = ""  # the group's first reward failure, one line
    rewards_by_fn: dict[str, list[float]] | None = None  # each reward function's G rewards (before weighting)


def prompt_tokens(tokenizer, example: Example, system_prompt: str = "") -> list[int]:
    """The chat-templated prompt (a record's own messages, or its prompt as the user turn), ending with the assistant
    header, as token ids."""
    text = tokenizer.apply_chat_template(example.chat(system_prompt), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, stop_tokens: list[str]) -> tuple[int, ...]:
    ids = []
    for tok in stop_tokens:
        enc = tokenizer(tok, add_special_tokens=False)["input_ids"]
        if len(enc) != 1:
            raise ConfigError(f"rollout.stop_tokens: {tok!r} is {len(enc)} tokens for this tokenizer, not one")
        ids.append(enc[0])
    return tuple(ids)


class RolloutActor:
    def __init__(self, config: Config, model_path: str):
        from transformers import AutoTokenizer

        from mint.models.lora import add_lora
        from mint.models.specs import load_model, usable_vocab
        from mint.rl.reward_set import RewardSet
        from mint.rollout.engine import RolloutEngine

        torch.set_num_threads(config.ray.torch_threads)
        self.config = config
        use_cuda = config.ray.rollout_gpus > 0 and torch.cuda.is_available()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = add_lora(load_model(model_path, config.model.dtype), config.lora, config.grpo.seed)
        self.model = model.to("cuda") if use_cuda else model
        eos = self.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        limit = usable_vocab(len(self.tokenizer), self.model.config)
        self.engine = RolloutEngine(self.model, sorted(set(eos_ids)), vocab_limit=limit)
        r = config.rollout
        self.params = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_tokens,
            stop_token_ids=stop_token_ids(self.tokenizer, r.stop_tokens),
        )
        self.rewards = RewardSet(config.data.reward, config.data.reward_timeout)
        self.revision: str | None = None
        # Prompt tokens that leave room for max_tokens in the model's positions (preflight checked the data set).
        self.max_prompt = self.model.config.max_position_embeddings - r.max_tokens

    def pid(self) -> int:
        import os

        return os.getpid()

    def where(self) -> str:
        """ "(pid N on NODE_IP)": how the driver names this actor when it dies."""
        import os

        import ray

        return f"(pid {os.getpid()} on {ray.util.get_node_ip_address()})"

    def load_adapter(self, revision: str, data: bytes | None = None, catalog: str | None = None) -> str:
        """Hot-load adapter revision `revision`; the base never moves.

        With `data` (its safetensors bytes, as the driver ships them through the object store) the tensors must hash
        to `revision`, or nothing is loaded; without, they are read from the `catalog` directory by id (hash
        verified there). sha256 runs at about 1 GB/s, a small price next to sampling with the wrong weights.
        """
        from mint.errors import MintError
        from mint.hub import from_bytes, revision_id
        from mint.models.lora import load_lora_state

        if data is not None:
            tensors = from_bytes(data)
            if revision_id(tensors) != revision:
                raise MintError(f"load_adapter: bytes do not hash to revision {revision[:12]}; refusing to load")
        elif catalog is not None:
            from mint.hub import Catalog

            with Catalog(catalog, create=False) as store:
                tensors, meta = store.load(revision)
            revision = meta.id
        else:
            raise MintError("load_adapter: give the revision's bytes or a catalog to read it from")
        load_lora_state(self.model, tensors)
        self.revision = revision
        return revision

    def evaluate(
        self, examples: list[Example], n: int, temperature: float, seed: int, revision: str
    ) -> list[list[float]]:
        """n responses per held-out prompt at the eval temperature with the current revision: their rewards."""
        if revision != self.revision:
            raise StaleRevision(
                f"rollout actor holds revision {(self.revision or 'none')[:12]}, asked for {revision[:12]}"
            )
        params = SamplingParams(
            temperature=temperature,
            max_tokens=self.config.rollout.max_tokens,
            stop_token_ids=self.params.stop_token_ids,
        )
        prompts = [self._prompt(ex) for ex in examples]
        groups = self.engine.generate(prompts, n, params, seed)
        responses = [
            self.tokenizer.decode(c.tokens_R.tolist(), skip_special_tokens=True) for g in groups for c in g.completions
        ]
        total = self.rewards.score(responses, [ex for ex in examples for _ in range(n)]).total
        return [list(total[i * n : (i + 1) * n]) for i in range(len(examples))]

    def _prompt(self, ex: Example) -> list[int]:
        tokens = prompt_tokens(self.tokenizer, ex, self.config.data.system_prompt)
        if len(tokens) > self.max_prompt:
            if not self.config.data.truncate_prompts:
                raise ConfigError(
                    f"data.source: a prompt of {len(tokens)} tokens exceeds the {self.max_prompt} that fit; "
                    "set data.truncate_prompts=true to keep its last tokens"
                )
            tokens = tokens[-self.max_prompt :]  # the end holds the question and the assistant header
        return tokens

    def rollout(self, examples: list[Example], seed: int, revision: str | None = None) -> list[GroupResult]:
        """Sample and score one shard. With `revision`, refuse (StaleRevision) unless that is the adapter loaded: a
        call to an actor Ray restarted since the last load would otherwise sample with the initial adapter."""

        if revision is not None and revision != self.revision:
            held = self.revision[:12] if self.revision else "none"
            raise StaleRevision(f"rollout actor holds revision {held}, asked for {revision[:12]}")

        prompts = [self._prompt(ex) for ex in examples]
        groups = self.engine.generate(prompts, self.config.rollout.group_size, self.params, seed)
        G = self.config.rollout.group_size
        responses = [
            [self.tokenizer.decode(c.tokens_R.tolist(), skip_special_tokens=True) for c in group.completions]
            for group in groups
        ]
        # One scoring call for the whole shard, so async rewards (a sandbox, a judge) run concurrently.
        scored = self.rewards.score([r for rs in responses for r in rs], [ex for ex in examples for _ in range(G)])
        results = []
        for i, (ex, group) in enumerate(zip(examples, groups, strict=True)):
            part = scored.part(i * G, (i + 1) * G)
            results.append(
                GroupResult(
                    ex,
                    group,
                    responses[i],
                    list(part.total),
                    part.failed_samples,
                    self.revision,
                    part.first_error,
                    {name: list(values) for name, values in part.rewards.items()},
                )
            )
        return results
