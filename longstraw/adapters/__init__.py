"""Architecture adapters: how to capture a prompt's state and run tokens against it, per model family.

`adapter_for(model)` picks one by `config.model_type`. To add a family, write an `Adapter` (see base.py) with its
own prefix-state type and register it in ADAPTERS.
"""

from __future__ import annotations

from torch import nn

from longstraw.adapters.base import Adapter, KVState, LayeredState, PrefixState, RecurrentState
from longstraw.adapters.dsa import DsaAdapter
from longstraw.adapters.glm import GlmAdapter
from longstraw.adapters.hybrid import HybridQwenAdapter
from longstraw.adapters.mla import MlaAdapter
from longstraw.adapters.qwen import QwenAdapter
from longstraw.errors import LongStrawError

ADAPTERS: dict[str, type[Adapter]] = {
    "qwen3_moe": QwenAdapter,
    "qwen2_moe": QwenAdapter,
    "qwen3": QwenAdapter,
    "qwen2": QwenAdapter,
    "glm4_moe": GlmAdapter,
    **{family: HybridQwenAdapter for family in HybridQwenAdapter.families},
    **{family: MlaAdapter for family in MlaAdapter.families},
    **{family: DsaAdapter for family in DsaAdapter.families},
}

__all__ = ["ADAPTERS", "Adapter", "KVState", "LayeredState", "PrefixState", "RecurrentState", "adapter_for"]


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for a HF causal LM (plain or PEFT-wrapped); LongStrawError for an unsupported family."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ADAPTERS:
        raise LongStrawError(
            f"no LongStraw adapter for model_type {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type](model)
