"""Rollout engines: sample G responses per prompt with per-token logprobs and (for MoE bases) routed expert ids.

`engine.RolloutEngine` is the built-in engine (exact, the CPU and CI path).
"""

from mint.rollout.engine import GroupRollout, RolloutEngine, SamplingParams

__all__ = ["GroupRollout", "RolloutEngine", "SamplingParams"]
