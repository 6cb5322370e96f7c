"""Architecture adapters: how to capture a prompt's state and run tokens against it, one per attention kind.

`adapter_for(model)` picks one from what the model's modules are, never from a list of family names, so a new
family whose layers are of a kind already here needs no change in LongStraw:

- a decoder layer with `linear_attn` (Gated DeltaNet beside gated full attention: Qwen3.5, Qwen3-Next):
  `HybridQwenAdapter`, K/V pages plus a recurrent boundary;
- attention with `kv_a_proj_with_mqa` (multi-head latent attention: DeepSeek-V3, GLM-4.7-Flash): `MlaAdapter`,
  latent pages; with an `indexer` too (DSA: DeepSeek-V3.2, GLM-5): `DsaAdapter`, indexer pages beside them;
- attention with q/k/v/o projections (Qwen2/3, Qwen2/3-MoE, GLM-4.5): `QwenAdapter`, K/V pages; q/k norm, partial
  RoPE, biases and the head dim are read from the module.

Each adapter then asks the modules for what varies within its kind. Router rules (R3) are keyed by router class in
`longstraw.router_rules`, for the same reason. To add a kind, write an `Adapter` (see base.py) with its own
prefix-state type and a test of `_kind` here.
"""

from __future__ import annotations

from torch import nn

from longstraw.adapters.base import Adapter, KVState, LayeredState, PrefixState, RecurrentState
from longstraw.adapters.dsa import DsaAdapter
from longstraw.adapters.hybrid import HybridQwenAdapter
from longstraw.adapters.mla import MlaAdapter
from longstraw.adapters.qwen import QwenAdapter
from longstraw.errors import LongStrawError

KINDS: dict[str, type[Adapter]] = {
    "hybrid": HybridQwenAdapter,
    "dsa": DsaAdapter,
    "mla": MlaAdapter,
    "gqa": QwenAdapter,
}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

__all__ = ["KINDS", "Adapter", "KVState", "LayeredState", "PrefixState", "RecurrentState", "adapter_for", "kind_of"]


def kind_of(model: nn.Module) -> str | None:
    """The attention kind of a HF causal LM (plain or PEFT-wrapped), read off its decoder layers: "hybrid", "dsa",
    "mla", "gqa", or None when no adapter covers its layers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = list(getattr(getattr(base, "model", None), "layers", None) or [])
    if not layers:
        return None
    if any(hasattr(layer, "linear_attn") for layer in layers):
        return "hybrid"
    attns = [layer.self_attn for layer in layers if hasattr(layer, "self_attn")]
    if not attns:
        return None
    if all(hasattr(a, "kv_a_proj_with_mqa") for a in attns):
        return "dsa" if any(getattr(a, "indexer", None) is not None for a in attns) else "mla"
    if all(all(hasattr(a, p) for p in _PROJECTIONS) for a in attns):
        return "gqa"
    return None


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for a HF causal LM (plain or PEFT-wrapped); LongStrawError for layers no adapter covers."""
    kind = kind_of(model)
    if kind is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = getattr(getattr(base, "model", None), "layers", None) or []
        attn = next((type(getattr(layer, "self_attn", layer)).__name__ for layer in layers), type(base).__name__)
        model_type = getattr(getattr(base, "config", None), "model_type", None)
        raise LongStrawError(
            f"no LongStraw adapter for {attn} layers (model_type {model_type!r}); LongStraw covers softmax attention "
            f"with q/k/v/o projections, multi-head latent attention (with or without a DSA indexer) and Gated "
            f"DeltaNet hybrids"
        )
    return KINDS[kind](model)
