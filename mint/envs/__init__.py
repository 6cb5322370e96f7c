"""Multi-turn environments for agentic RL: the interface (token in, token out), the episode runner and record, the
family tool-call formats (mint.envs.tool_calls), chat observations as template deltas (mint.envs.chat), the Python
sandbox tool (mint.envs.sandbox) and the built-in environments (registry). No Ray, no learner, no torch: episodes are
token records that the rollout side produces and the learner replays."""

from mint.envs.env import Env, EnvGroupBuilder, StepResult, StopCondition, StopReason, Tokens
from mint.envs.episode import Episode, EpisodeLimits, Policy, Sample, Turn, run_episode, run_group

__all__ = [
    "Env",
    "EnvGroupBuilder",
    "Episode",
    "EpisodeLimits",
    "Policy",
    "Sample",
    "StepResult",
    "StopCondition",
    "StopReason",
    "Tokens",
    "Turn",
    "run_episode",
    "run_group",
]
