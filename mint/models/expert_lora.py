"""Factored LoRA on fused MoE experts: two small matmuls per routed row, never W + ΔW.

PEFT puts LoRA on a fused expert parameter W [E, O, I] (transformers 5.x `gate_up_proj` [E, 2I_moe, H] and
`down_proj` [E, H, I_moe]) through a ParamWrapper that parametrizes W as W + s·B_e A_e for every forward. That
forms a new [E, O, I] tensor per wrapped parameter and forward, and the expert matmuls save it for backward: 1.21 GB
per MoE layer at Qwen3-30B-A3B dims, 99% of a replay's saved bytes, rebuilt at every decode step.

`factor_experts` keeps PEFT's modules, parameters and state-dict names exactly, and only replaces how the outermost
ParamWrapper of each experts module computes its forward (an instance-level `forward`). With a single active,
unmerged adapter the experts' output is computed here, from the frozen base weights and the two wrappers' factors:

    per routed pair (token t, slot j) with expert e = top_k_index[t, j] and weight w = top_k_weights[t, j]:
        gu = x_t W_gu[e]^T + s_gu (x_t A_gu[e]^T) B_gu[e]^T          [2I]   gate, up = chunk(gu, 2)
        h  = act(gate) * up                                          [I]
        y  = h W_d[e]^T  + s_d  (h A_d[e]^T) B_d[e]^T                [H]
        out_t += w y

The pairs are sorted by expert once per layer. The base matmuls run per expert segment (one torch grouped matmul where
transformers' grouped_mm forward would run one: CUDA, sm80+), and the LoRA term is `mint_kernels.expert_lora`
over the same segments. The combine mirrors the forward the model's `config._experts_implementation` selects: `eager`
adds rows with index_add_ in the output dtype (transformers' Qwen3MoeExperts.forward), the others unpermute and sum
the k slots per token (transformers' grouped_mm / batched_mm forwards; deterministic on CUDA). With adapters disabled
(`disable_adapter()`, the KL reference), merged, or in any other PEFT state, PEFT's own forward runs unchanged.

What backward keeps: the routed rows (x sorted, gate/up, h, y), the base weights by reference, and what the kernel
saves (its inputs and the rank-r intermediate); nothing of size E·O·I is formed.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

import mint_kernels
from mint.errors import ConfigError
from mint.models.quant import ExpertWeight, compute_dtype_view, is_quantized_experts

GATE_UP, DOWN = "gate_up_proj", "down_proj"
_FACTORED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def factor_experts(peft_model: nn.Module) -> int:
    """Make every fused-experts LoRA of `peft_model` compute factored; returns how many experts modules it covers.

    Idempotent, and safe to call again after `add_adapter` (the wrappers stay the same modules). Raises ConfigError
    for an experts module whose layout the factored forward does not mirror (see `_check_layout`).
    """
    count = 0
    for name, module, wrappers in expert_wrappers(peft_model):
        if hasattr(module, "_mint_expert_shard"):  # expert-parallel: its forward already dispatches (expert_parallel)
            continue
        _check_layout(name, wrappers)
        if not is_factored(module):
            module.forward = types.MethodType(_factored_forward, module)
        count += 1
    return count


def is_factored(module: nn.Module) -> bool:
    """Whether `module` (an outermost expert ParamWrapper) runs the factored forward."""
    return "forward" in vars(module) and getattr(module.forward, "__func__", None) is _factored_forward


# ---- structure ------------------------------------------------------------------------------------------------------


def expert_wrappers(peft_model: nn.Module) -> Iterator[tuple[str, nn.Module, list[nn.Module]]]:
    """(name, outermost ParamWrapper, its chain down to the experts module) for every experts module with LoRA;
    the inner wrappers of a chain are not yielded on their own."""
    inner: set[int] = set()
    for name, module in peft_model.named_modules():  # parents come before their children
        wrappers = _wrapper_chain(module)
        if not wrappers or id(module) in inner:
            continue
        inner.update(id(w) for w in wrappers[1:])
        yield name, module, wrappers


def _wrapper_chain(module: nn.Module) -> list[nn.Module]:
    """The nested ParamWrappers starting at `module`, outermost first; [] when `module` is not one."""
    chain = []
    while isinstance(module, ParamWrapper):
        chain.append(module)
        module = module.base_layer
    return chain


def _check_layout(name: str, wrappers: list[nn.Module]) -> None:
    """Refuse, by name, any experts module the factored math would not reproduce."""
    experts = wrappers[-1].base_layer
    by_param = {w.parameter_name: w for w in wrappers}
    hint = "build it with add_lora(..., factored_experts=False) for PEFT's materialized path"
    if sorted(by_param) != sorted((GATE_UP, DOWN)) or len(wrappers) != 2:
        raise ConfigError(f"lora: {name}: factored experts need LoRA on exactly {GATE_UP} and {DOWN}; {hint}")
    flags = dict(is_transposed=False, has_bias=False, has_gate=True, is_concatenated=True, has_post_expert_norm=False)
    wrong = [k for k, want in flags.items() if getattr(experts, k, want) != want]
    gate_up, down = (ExpertWeight(experts, p) if hasattr(experts, p) else None for p in (GATE_UP, DOWN))
    shapes_ok = (
        gate_up is not None
        and down is not None
        and len(gate_up.shape) == 3
        and len(down.shape) == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
        and hasattr(experts, "act_fn")
    )
    swapped = all(getattr(w, "_did_swap_in_out_features", False) for w in wrappers)
    if wrong or not shapes_ok or not swapped:
        why = f"flags {wrong}" if wrong else "weights are not gate_up [E, 2I, H] / down [E, H, I] with act_fn"
        raise ConfigError(
            f"lora: {name}: {type(experts).__name__} is not supported by factored experts ({why}); {hint}"
        )


def _active_adapter(wrappers: list[nn.Module]) -> str | None:
    """The one adapter to apply factored, or None when PEFT's own forward should run (disabled, merged, none or
    several active, a dtype PEFT upcasts)."""
    adapter = None
    for w in wrappers:
        if w.disable_adapters or w.merged:
            return None
        active = [a for a in w.active_adapters if a in w.lora_A]
        if len(active) != 1 or (adapter is not None and active[0] != adapter):
            return None
        adapter = active[0]
        if w.get_param().dtype not in _FACTORED_DTYPES and not is_quantized_experts(wrappers[-1].base_layer):
            return None
    return adapter


# ---- forward --------------------------------------------------------------------------------------------------------


def _factored_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    """Installed as the outermost expert ParamWrapper's `forward`; same signature as the experts' forward."""
    wrappers = _wrapper_chain(self)
    adapter = None if (args or kwargs) else _active_adapter(wrappers)
    if adapter is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    by_param = {w.parameter_name: w for w in wrappers}
    gate_up, down, experts = by_param[GATE_UP], by_param[DOWN], wrappers[-1].base_layer
    return experts_forward(experts, gate_up, down, adapter, hidden_states, top_k_index, top_k_weights)


def base_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts' own output (no LoRA) by the same path: the forward of quantized experts (mint.models.quant),
    which transformers' forwards cannot run."""
    return experts_forward(self, None, None, None, hidden_states, top_k_index, top_k_weights)


def experts_forward(
    experts: nn.Module,
    gate_up_lora: nn.Module | None,
    down_lora: nn.Module | None,
    adapter: str | None,
    x_T_H: torch.Tensor,
    top_k_index_T_K: torch.Tensor,
    top_k_weights_T_K: torch.Tensor,
) -> torch.Tensor:
    """The experts' output with LoRA applied factored (none when `adapter` is None). x [T, H]; ids and weights
    [T, k] -> [T, H]. Quantized experts dequantize per expert segment inside the matmul (`ExpertWeight`).

    Ids equal to E (transformers' expert-parallel sentinel) are skipped, as transformers' forwards skip them.
    """
    T, K = top_k_index_T_K.shape
    W_gu_E_O_H, W_d_E_H_I = ExpertWeight(experts, GATE_UP), ExpertWeight(experts, DOWN)
    E = W_gu_E_O_H.shape[0]

    # Sort the T*k (token, slot) pairs by expert once; offsets from the sorted ids need no host-side counting.
    ids_N = top_k_index_T_K.reshape(-1)
    sorted_ids_N, perm_N = torch.sort(ids_N, stable=True)
    bounds = torch.arange(E + 1, device=ids_N.device, dtype=sorted_ids_N.dtype)
    offsets_E1 = torch.searchsorted(sorted_ids_N, bounds).to(torch.int64)
    ends = offsets_E1.tolist()  # one host sync per layer, as transformers' own expert loops
    n = ends[-1]  # pairs with a real expert; sentinel ids (== E) sort after them
    perm_N = perm_N[:n]
    x_N_H = x_T_H[perm_N // K]

    grouped = _grouped_mm_like_transformers(experts, x_N_H) and not W_gu_E_O_H.quantized
    gu_N_O = _segment_linear(x_N_H, W_gu_E_O_H, offsets_E1, ends, grouped)
    if adapter is not None:
        gu_N_O = gu_N_O + _lora(gate_up_lora, adapter, x_N_H, offsets_E1)
    h_N_I = experts._apply_gate(gu_N_O) if hasattr(experts, "_apply_gate") else _default_gate(experts, gu_N_O)
    y_N_H = _segment_linear(h_N_I, W_d_E_H_I, offsets_E1, ends, grouped)
    if adapter is not None:
        y_N_H = y_N_H + _lora(down_lora, adapter, h_N_I, offsets_E1)
    y_N_H = y_N_H * top_k_weights_T_K.reshape(-1)[perm_N, None]

    if _implementation(experts) == "eager":
        # Qwen3MoeExperts.forward: index_add_ into zeros in the output dtype, expert by expert. Each token appears
        # at most once per expert, so one index_add_ over the expert-sorted rows adds in the same order.
        out_T_H = torch.zeros_like(x_T_H)
        return out_T_H.index_add_(0, perm_N // K, y_N_H.to(out_T_H.dtype))
    # grouped_mm / batched_mm: back to (token, slot) order and a sum over the k slots (fp32 accumulation inside the
    # reduction, deterministic on CUDA where index_add_ uses atomics). Sentinel slots stay zero.
    full_TK_H = y_N_H.new_zeros(T * K, y_N_H.shape[-1]).index_copy(0, perm_N, y_N_H)
    return full_TK_H.view(T, K, -1).sum(dim=1).to(x_T_H.dtype)


def _default_gate(experts: nn.Module, gu_N_O: torch.Tensor) -> torch.Tensor:
    gate, up = gu_N_O.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _lora(wrapper: nn.Module, adapter: str, x_N_I: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """s · (x A_e^T) B_e^T per expert segment, through the kernel API; factors as PEFT's `get_delta_factors`
    gives them for a swapped (E, out, in) parameter: B [E, O, r], A [E, r, I], in the parameter's dtype."""
    experts = _wrapper_chain(wrapper)[-1].base_layer
    if is_quantized_experts(experts):  # PEFT casts the factors to the base weight's dtype, here FP8
        with compute_dtype_view(experts, wrapper.lora_A[adapter].weight.dtype):
            B_E_O_R, A_E_R_I, scaling = wrapper.get_delta_factors(adapter)
    else:
        B_E_O_R, A_E_R_I, scaling = wrapper.get_delta_factors(adapter)
    return mint_kernels.expert_lora(x_N_I, A_E_R_I, B_E_O_R, offsets_E1, scaling)


def _implementation(experts: nn.Module) -> str | None:
    """The experts forward transformers dispatches to for this module (`config._experts_implementation`)."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None)


def _grouped_mm_like_transformers(experts: nn.Module, x: torch.Tensor) -> bool:
    """Whether transformers' grouped_mm forward would run torch's grouped matmul here: on CUDA at sm80+ (as its
    `_can_use_grouped_mm` decides). On CPU it also may, but the per-segment loop gave bit-identical results there
    (fp32 and bf16), so the CPU path stays the loop. Mirroring the base matmul keeps B = 0 bit-identical to the base
    model, so the KL to the reference is exactly 0 before the first update."""
    if _implementation(experts) != "grouped_mm" or not x.is_cuda or not hasattr(F, "grouped_mm"):
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 0)


def _segment_linear(x_N_I, W_E_O_I: ExpertWeight, offsets_E1, ends: list[int], grouped: bool) -> torch.Tensor:
    """Row segment e of x times W[e]^T, for rows sorted by expert. x [N, I]; W [E, O, I] -> [N, O].

    grouped: one torch grouped matmul (what transformers' grouped_mm forward runs on GPUs); otherwise a loop of
    F.linear over the non-empty segments (transformers' eager forward, and its grouped fallback), each dequantizing
    its expert's weight first when the experts are quantized.
    """
    if grouped and x_N_I.shape[0] > 0:
        W = W_E_O_I.weight
        return F.grouped_mm(x_N_I.to(W.dtype), W.transpose(-2, -1), offs=offsets_E1[1:].to(torch.int32))
    parts = [W_E_O_I.linear(x_N_I[lo:hi], e) for e, (lo, hi) in enumerate(itertools.pairwise(ends)) if hi > lo]
    if not parts:
        return x_N_I.new_zeros(0, W_E_O_I.shape[1])
    return torch.cat(parts)
