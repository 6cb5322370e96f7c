"""Held-out evaluation and sample logs: what a researcher reads besides the training reward.

Eval samples `eval.samples` responses per held-out prompt at `eval.temperature` with the current revision, on the
rollout actors, and reports the mean reward, pass@1 and, for n > 1, pass@n with the unbiased estimator
1 - C(n - c, k) / C(n, k) (c responses of n pass, a pass being reward >= eval.pass_threshold). It draws from its own
seeds, so it never changes what training samples: an eval key may be changed on --resume.
"""

from __future__ import annotations

import math

from mint.config import Config
from mint.rl.data import EVAL_SEED, eval_examples
from mint.rl.grpo import group_advantages_batch
from mint.train.rollout_fleet import RolloutFleet
from mint.train.step import Revision


def eval_set(config: Config) -> list:
    """The run's held-out prompts (mint.rl.data.eval_examples)."""
    c = config
    return eval_examples(c.eval.source, c.eval.max_prompts, c.data.prompt_key, c.data.answer_key)[0]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k draws (without replacement) from n responses, c of them passing, passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(fleet: RolloutFleet, examples: list, config: Config, step: int, rev: Revision) -> dict[str, float]:
    """eval_reward_mean, eval_pass@1 (and eval_pass@n) over the held-out prompts at revision `rev` (its id, and its
    bytes in the object store).

    Recovered as a training rollout is (RolloutFleet.collect, its one recovery path): a shard whose actor died, or
    was restarted by Ray and so refuses with StaleRevision, is redone with the same seed once the actor holds `rev`
    again (loaded from its bytes); a shard lost to an engine server the run started is redone once the server is
    back."""
    if not examples:
        return {}
    e = config.eval
    call = fleet.submit_rollout(examples, EVAL_SEED + step * 1000, rev, (e.samples, e.temperature))
    rewards = fleet.collect(call)  # one list of n rewards per prompt
    n = e.samples
    passes = [sum(value >= e.pass_threshold for value in r) for r in rewards]
    out = {
        "eval_reward_mean": sum(map(sum, rewards)) / (n * len(rewards)),
        "eval_pass@1": sum(pass_at_k(n, c, 1) for c in passes) / len(passes),
    }
    if n > 1:
        out[f"eval_pass@{n}"] = sum(pass_at_k(n, c, n) for c in passes) / len(passes)
    return out


def sample_rows(config: Config, step: int, results: list, rewards_B_G) -> list[dict]:
    """A few groups' first two responses with their rewards and advantages, for samples.jsonl and the console."""
    adv_B_G = group_advantages_batch(rewards_B_G, scale_std=config.grpo.scale_std)
    rows = []
    for b, res in enumerate(results[: config.logging.samples_per_step]):
        for i in range(min(2, len(res.responses))):
            rows.append(
                {
                    "step": step,
                    "prompt": res.example.prompt,
                    "answer": res.example.answer,
                    "completion": res.responses[i],
                    "reward": float(rewards_B_G[b, i]),
                    "advantage": float(adv_B_G[b, i]),
                }
            )
            if res.episodes:  # a multi-turn episode: its turns, each action with the observation after it
                rows[-1].update(turns=res.episodes[i]["turns"], stop_reason=res.episodes[i]["stop_reason"])
    return rows
