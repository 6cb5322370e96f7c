"""`rollout.backend = builtin`: the built-in engine in the rollout actor's own process (exact; the CPU and CI path).

The actor holds the base plus a LoRA adapter and loads each revision's tensors into it (`mint.models.lora`), so
`load_adapter` takes tensors here instead of a directory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mint.models.lora import load_lora_state
from mint.rollout.backends.base import RolloutBackend
from mint.rollout.engine import GroupRollout, RolloutEngine, SamplingParams


class BuiltinBackend(RolloutBackend):
    name = "builtin"

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def generate(
        self, prompts: list[Sequence[int]], group_size: int, params: SamplingParams, seed: int
    ) -> list[GroupRollout]:
        return self.engine.generate(prompts, group_size, params, seed)

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        load_lora_state(self.engine.model, tensors)
