"""RolloutActor: samples G responses per prompt on its rollout backend and scores them with the reward function.

`rollout.backend = builtin`: the actor holds the frozen base plus a LoRA adapter of the same shape as the learner's
and samples in process. `vllm` / `sglang`: it fronts the engine servers the fleet hands it (actor j: every num_actors-th
URL from j of `engines.urls`, or of the servers the run started) and holds only the tokenizer; `mint.rollout.backends`
speaks their protocols.

Weight sync is a revision publish. `load_adapter(id, bytes)` takes the revision's safetensors bytes straight from
the learner (an object ref: no driver hop), refuses bytes that do not hash to the id the driver admitted, and
installs them: into the in-process adapter, or as a directory written on this actor's node in the layout its engines
load (per-expert for expert LoRA on vLLM/SGLang, else PEFT: engines.adapter_layout), loaded there (load_inplace on
vLLM) before the call returns, so no later request samples the old revision. `reinstall(url)` loads the current
revision again on one engine that was restarted. The rollout fleet (mint.train.rollout_fleet) makes every call.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mint.config import Config, response_room
from mint.envs.registry import resolve_env
from mint.errors import MintError
from mint.rl.tasks import Example
from mint.rollout.engine import GroupRollout, SamplingParams
from mint.rollout.prompts import prompt_tokens, stop_token_ids
from mint.train import wire
from mint.train.preflight import check_prompt_lengths, engine_adapter_config, engine_adapter_layout


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
    episodes: list[dict] | None = None  # multi-turn (env.name): each episode's `episode_summary`


class RolloutActor:
    def __init__(self, config: Config, model_path: str, index: int = 0, urls: Sequence[str] = ()):
        from transformers import AutoTokenizer

        from mint.rl.reward_set import RewardSet

        wire.register()  # the groups this actor returns carry their tensors as numpy buffers
        torch.set_num_threads(config.ray.torch_threads)
        self.config = config
        self.index = index
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if config.rollout.backend == "builtin":
            max_positions = self._start_builtin(config, model_path)
        else:
            max_positions = self._start_http(config, model_path, index, urls)
        r = config.rollout
        self.params = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_tokens,
            stop_token_ids=stop_token_ids(self.tokenizer, r.stop_tokens),
        )
        self.rewards = RewardSet(config.data.reward, config.data.reward_timeout)
        self.revision: str | None = None
        # Prompt tokens that leave room for max_tokens in the model's positions (preflight checked the data set);
        # an episode's room is its whole tail (env.max_tokens).
        self.max_positions = max_positions
        self.max_prompt = max_positions - response_room(config)[1]
        self.env_factory = resolve_env(config.env.name) if config.env.name else None

    def _start_builtin(self, config: Config, model_path: str) -> int:
        """The base plus LoRA in this process, sampled by the built-in engine."""
        from mint.models.lora import add_lora
        from mint.models.specs import load_model, usable_vocab
        from mint.rollout.backends.builtin import BuiltinBackend
        from mint.rollout.engine import RolloutEngine

        use_cuda = config.ray.rollout_gpus > 0 and torch.cuda.is_available()
        base = load_model(model_path, config.model.dtype, config.model.quantization)
        model = add_lora(base, config.lora, config.grpo.seed)
        self.model = model.to("cuda") if use_cuda else model
        eos = self.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        limit = usable_vocab(len(self.tokenizer), self.model.config)
        self.engine = RolloutEngine(
            self.model, sorted(set(eos_ids)), vocab_limit=limit, record_indexer=config.grpo.indexer_replay
        )
        self.backend = BuiltinBackend(self.engine)
        return self.model.config.max_position_embeddings

    def _start_http(self, config: Config, model_path: str, index: int, urls: Sequence[str]) -> int:
        """The engine servers at `urls` (the fleet hands actor j its share), which already run: health-checked here,
        so a dead one stops the run with one line."""
        from transformers import AutoConfig

        from mint.config import run_dir
        from mint.hub import base_fingerprint
        from mint.models.specs import moe_layout, text_config
        from mint.rollout.backends import http_backend

        r, e = config.rollout, config.engines
        model_config = AutoConfig.from_pretrained(model_path)
        self.model = self.engine = None
        self.backend = http_backend(r.backend, urls, moe_layout(model_config), e.request_timeout)
        self.adapter_root = Path(e.adapter_dir or run_dir(config) / "engine_adapters") / f"actor_{index}"
        self.adapter_config = engine_adapter_config(config, model_config, model_path)
        self.adapter_meta = {
            "run": config.logging.name,
            "base_model": config.model.path,
            "base_fingerprint": base_fingerprint(model_path),
        }
        # The layout the engine loads (per-expert for vLLM/SGLang expert LoRA), decided once; so is the expert
        # metadata the split reads (a meta-device skeleton of the base, cached by mint.hub per process). Preflight
        # refused an explicit layout the engine cannot read; this is the same check, for an actor started alone.
        self.base_config = model_config
        self.adapter_layout = engine_adapter_layout(config, model_config, self.adapter_config)
        return text_config(model_config).max_position_embeddings

    def pid(self) -> int:
        import os

        return os.getpid()

    def where(self) -> str:
        """ "(pid N on NODE_IP)": how the driver names this actor when it dies."""
        import os

        import ray

        return f"(pid {os.getpid()} on {ray.util.get_node_ip_address()})"

    def load_adapter(self, revision: str, data: bytes) -> str:
        """Hot-load adapter revision `revision` from `data`, its safetensors bytes as the driver ships them through
        the object store; the base never moves. The tensors must hash to `revision`, or nothing is loaded: sha256
        runs at about 1 GB/s, a small price next to sampling with the wrong weights."""
        from mint.hub import from_bytes, revision_id

        tensors = from_bytes(data)
        if revision_id(tensors) != revision:
            raise MintError(f"load_adapter: bytes do not hash to revision {revision[:12]}; refusing to load")
        self._install(revision, tensors)
        return revision

    def reinstall(self, url: str) -> bool:
        """Load the current revision again on engine `url` only: the rollout fleet restarted that server, which lost
        its adapters. The revision's directory is still on this node (`_install` keeps the current one). False when
        this actor does not front `url` or holds no revision yet (the new server then serves the base, as the old
        one did)."""
        url = url.rstrip("/")
        if self.config.rollout.backend == "builtin" or self.revision is None or url not in self.backend.urls:
            return False
        self.backend.load_on(url, self.revision, self.adapter_root / f"rev_{self.revision}")
        return True

    def _install(self, revision: str, tensors: dict) -> None:
        """Make `revision` the adapter every later sample uses: in process, or on the engines through a directory on
        this node in the layout they load (`engines.adapter_layout`; split once per revision, written atomically; the
        current and the previous revision's directories stay)."""
        if self.config.rollout.backend == "builtin":
            self.backend.load_tensors(tensors)
        elif revision != self.revision:
            from mint.hub import write_adapter_dir

            target = self.adapter_root / f"rev_{revision}"
            layout, base = self.adapter_layout, self.base_config
            write_adapter_dir(target, revision, tensors, self.adapter_config, self.adapter_meta, layout, base)
            self.backend.load_adapter(revision, target)
            keep = {target.name} | ({f"rev_{self.revision}"} if self.revision else set())
            for old in self.adapter_root.glob("rev_*"):
                if old.name not in keep:
                    shutil.rmtree(old, ignore_errors=True)
        self.revision = revision

    def _sample_groups(self, prompts: list[list[int]], group_size: int, params: SamplingParams, seed: int):
        """The seam between the actor and its backend: one GroupRollout per prompt."""
        return self.backend.generate(prompts, group_size, params, seed)

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
        prompts = [self._prompt(ex, "eval.source") for ex in examples]
        groups = self._sample_groups(prompts, n, params, seed)
        responses = [
            self.tokenizer.decode(c.tokens_R.tolist(), skip_special_tokens=True) for g in groups for c in g.completions
        ]
        total = self.rewards.score(responses, [ex for ex in examples for _ in range(n)]).total
        return [list(total[i * n : (i + 1) * n]) for i in range(len(examples))]

    def _prompt(self, ex: Example, key: str = "data.source") -> list[int]:
        """The prompt's tokens as sampled: cut to its last max_prompt tokens under data.truncate_prompts, else a
        ConfigError naming `key` (preflight checked the files and the first draws of a stream with the same check)."""
        tokens = prompt_tokens(self.tokenizer, ex, self.config.data.system_prompt)
        if check_prompt_lengths(key, [len(tokens)], self.max_prompt, self.config):
            tokens = tokens[-self.max_prompt :]  # the end holds the question and the assistant header
        return tokens

    def rollout(self, examples: list[Example], seed: int, revision: str | None = None) -> list[GroupResult]:
        """Sample and score one shard. With `revision`, refuse (StaleRevision) unless that is the adapter loaded: a
        call to an actor Ray restarted since the last load would otherwise sample with the initial adapter."""

        if revision is not None and revision != self.revision:
            held = self.revision[:12] if self.revision else "none"
            raise StaleRevision(f"rollout actor holds revision {held}, asked for {revision[:12]}")

        prompts = [self._prompt(ex) for ex in examples]
        if self.env_factory is not None:
            return self._rollout_episodes(examples, prompts, seed)
        groups = self._sample_groups(prompts, self.config.rollout.group_size, self.params, seed)
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

    def _rollout_episodes(self, examples: list[Example], prompts: list[list[int]], seed: int) -> list[GroupResult]:
        """One group of G episodes per prompt, driven by the environment `env.name` names (mint.envs), on the
        built-in engine or the engine servers; each group comes back as the GroupRollout the learner trains on
        (episode tails masked)."""
        from mint.envs import EpisodeLimits, StopCondition
        from mint.rollout.episodes import EnginePolicy, group_rollout, sample_episodes

        r, env = self.config.rollout, self.config.env
        stop = StopCondition(self.params.stop_token_ids, r.max_tokens)
        factory, tokenizer, config = self.env_factory, self.tokenizer, self.config
        builders = [factory(ex, tokenizer, config, p, stop) for ex, p in zip(examples, prompts, strict=True)]
        sampler = self.engine if self.config.rollout.backend == "builtin" else self.backend
        policy = EnginePolicy(sampler, self.revision or "", r.temperature, r.top_p, seed)
        limits = EpisodeLimits(env.max_turns, env.max_tokens, self.max_positions, env.step_timeout)
        results = []
        for ex, episodes in zip(examples, sample_episodes(policy, builders, limits), strict=True):
            rewards = [ep.reward for ep in episodes]
            texts = [self.tokenizer.decode(ep.tokens, skip_special_tokens=True) for ep in episodes]
            summary = [episode_summary(ep, self.tokenizer) for ep in episodes]
            results.append(GroupResult(ex, group_rollout(episodes), texts, rewards, 0, self.revision, episodes=summary))
        return results


def episode_summary(episode, tokenizer) -> dict:
    """What the step's metrics and samples.jsonl keep of an episode: its turns as text, their rewards, why it ended."""
    turns, metrics = [], {}
    for t in episode.turns:
        for name, value in t.metrics.items():
            metrics[name] = metrics.get(name, 0.0) + value
        action = episode.tokens[t.start : t.start + t.action]
        observation = episode.tokens[t.start + t.action : t.start + t.action + t.observation]
        turns.append(
            {
                "action": tokenizer.decode(action, skip_special_tokens=True),
                "observation": tokenizer.decode(observation, skip_special_tokens=True),
                "reward": t.reward,
                "masked": t.masked,
                "revision": t.revision,
            }
        )
    return {
        "turns": turns,
        "stop_reason": episode.stop_reason.value,
        "sampled_tokens": episode.sampled_tokens,
        "tokens": len(episode.tokens),
        "metrics": metrics,  # each turn metric summed over the episode
    }
