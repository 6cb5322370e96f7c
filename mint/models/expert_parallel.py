"""Expert parallel experts: each rank of an EP group holds its block of routed experts and their LoRA.

The layout (docs/sharding.md, "Expert parallel"): with `ep` ranks and E experts per MoE layer, rank r owns experts
[r·E/ep, (r+1)·E/ep). `shard_experts` converts a PeftModel built by `mint.models.lora.add_lora` in place:

    base    experts.gate_up_proj [E, 2I, H] -> [E_local, 2I, H] (rows lo:hi),  down_proj [E, H, I] -> [E_local, H, I]
    LoRA    names unchanged (PEFT's), shapes cut to the local experts; PEFT stores a fused-expert adapter as
            lora_A.weight [E·r, in]  (row e·r + i: expert-major)   -> rows lo·r : hi·r           [E_local·r, in]
            lora_B.weight [out, r·E] (column i·E + e: rank-major)  -> view(out, r, E)[:, :, lo:hi] [out, r·E_local]
            and each wrapper's num_experts becomes E_local, so PEFT's own `get_delta_factors` reads the slices.

`gather_expert_lora` undoes that mapping by name: A blocks concatenated by rank along rows, B blocks along the
expert axis of view(out, r, E_local). The result is `lora_state` of the unsharded model, key for key.

The forward installed on each experts module: dispatch the routed rows to their experts' ranks
(`longstraw.expert_parallel`), run base + LoRA on the local segments with the factored path's helpers
(`mint.models.expert_lora`: the base matmuls per segment or grouped, the LoRA term through
`mint_kernels.expert_lora`), combine back with the route weights on the token's rank. Routes are used as given,
so R3's replayed ids (set upstream, in the router) are the ones dispatched. With adapters disabled (the KL reference)
the same transport runs the base experts only.

Gradients: a local expert's LoRA gradient on its owner already sums every rank's tokens (the reverse all_to_all
brings them), so it must not be averaged with other ranks' (they hold other experts); the replicated (attention)
LoRA gradients are per rank and are reduced across the data-parallel group as today.

`load_expert_parallel` builds the same sharded model from a checkpoint without ever holding a full expert stack:
the dense weights are read whole, the routed experts' rows only for this rank (safetensors `get_slice`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
from accelerate import init_empty_weights  # a PEFT dependency: parameters on meta, buffers (RoPE) real
from peft.utils import get_peft_model_state_dict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from longstraw.expert_parallel import combine, dispatch
from mint.config import LoraConfig
from mint.errors import ConfigError
from mint.models.checkpoint_reader import CheckpointReader, PackedRows
from mint.models.expert_lora import (
    DOWN,
    GATE_UP,
    _active_adapter,
    _check_layout,
    _default_gate,
    _grouped_mm_like_transformers,
    _lora,
    _segment_linear,
    _wrapper_chain,
    expert_wrappers,
)
from mint.models.lora import add_lora, load_lora_state
from mint.models.quant import SCALE_SUFFIX, ExpertWeight, is_quantized_experts, quantize_experts
from mint.models.quant_int4 import pack_experts, scheme_of
from mint.models.specs import DTYPES

# load_slice(experts_module, parameter_name, lo, hi) -> the base parameter's rows lo:hi (e.g. read from a checkpoint)
SliceLoader = Callable[[nn.Module, str, int, int], torch.Tensor]


@dataclass(frozen=True)
class ExpertShard:
    """Where one experts module's local block sits: experts [first, first + per_rank) of num_experts."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    num_experts: int
    per_rank: int

    @property
    def first(self) -> int:
        return self.rank * self.per_rank


def shard_experts(peft_model: nn.Module, group: dist.ProcessGroup | None, load_slice: SliceLoader | None = None) -> int:
    """Keep only this rank's experts (base weights and LoRA factors) in every fused-experts module; returns how many.

    In place, before an optimizer is built: the non-local rows are dropped (new tensors, so the full stacks are
    freed once nothing else holds them). load_slice, when given, supplies the local base rows instead of slicing the
    resident ones (`load_expert_parallel` reads them from the checkpoint). No communication; every rank of `group`
    must call it. Raises ConfigError when E is not a multiple of the group size or for an unsupported layout.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    count = 0
    for name, module, wrappers in expert_wrappers(peft_model):
        if hasattr(module, "_mint_expert_shard"):
            raise ConfigError(f"expert parallel: {name} is already sharded")
        _check_layout(name, wrappers)
        experts = wrappers[-1].base_layer
        E = getattr(experts, GATE_UP).shape[0]
        if E % size:
            raise ConfigError(f"expert parallel: {name} has {E} experts, not a multiple of the EP group size {size}")
        shard = ExpertShard(group, rank, size, E, E // size)
        lo, hi = shard.first, shard.first + shard.per_rank
        # One expert's logical [O, I] (an INT4 module's packed words have another shape), before any is replaced.
        per_expert = {pname: ExpertWeight(experts, pname).shape[1:] for pname in (GATE_UP, DOWN)}
        for pname in (GATE_UP, DOWN):
            full = getattr(experts, pname)
            want = (shard.per_rank, *per_expert[pname])
            local = _local_rows(experts, pname, lo, hi, load_slice)
            if isinstance(local, PackedRows):  # INT4 rows and their group scales (mint.models.quant_int4)
                if (local.packed.shape[0], *local.shape) != want:
                    raise ConfigError(f"expert parallel: {name}.{pname}: got {local.shape} experts, want {want}")
                pack_experts(experts, {pname: (local.packed, local.scale)}, {pname: local.shape}, local.scheme)
                continue
            local, scale, block = local
            if tuple(local.shape) != want:
                raise ConfigError(f"expert parallel: {name}.{pname}: got {tuple(local.shape)} rows, want {want}")
            if scale is not None:  # FP8 rows and their block scales (mint.models.quant)
                quantize_experts(experts, {pname: (local, scale)}, block)
            else:
                setattr(experts, pname, nn.Parameter(local.to(full.dtype), requires_grad=False))
        if hasattr(experts, "num_experts"):
            experts.num_experts = shard.per_rank
        for wrapper in wrappers:
            _shard_lora(wrapper, shard)
        module._mint_expert_shard = shard
        module.forward = types.MethodType(_ep_forward, module)
        count += 1
    return count


def _local_rows(experts: nn.Module, pname: str, lo: int, hi: int, load_slice: SliceLoader | None):
    """(rows lo:hi of the base parameter, their FP8 block scales or None, the block size or None), or PackedRows for
    INT4 experts: read by `load_slice` (which returns such a triple for an FP8 checkpoint, PackedRows for an INT4
    one) or cut from the resident ones."""
    if load_slice is not None:
        local = load_slice(experts, pname, lo, hi)
        return local if isinstance(local, tuple | PackedRows) else (local, None, None)
    rows = getattr(experts, pname).detach()[lo:hi].clone()
    if not is_quantized_experts(experts):
        return rows, None, None
    if hasattr(experts, "packed_scheme"):
        scale = getattr(experts, pname + "_scale")[lo:hi].clone()
        return PackedRows(rows, scale, experts.packed_shapes[pname], experts.packed_scheme)
    return rows, getattr(experts, pname + SCALE_SUFFIX)[lo:hi].clone(), experts.fp8_block


def _shard_lora(wrapper: nn.Module, shard: ExpertShard) -> None:
    """Cut every adapter's factors of one ParamWrapper to the local experts (the mapping in the module docstring)."""
    if wrapper.num_experts != shard.num_experts:
        raise ConfigError(
            f"expert parallel: a LoRA wrapper has {wrapper.num_experts} experts, the base {shard.num_experts}"
        )
    for adapter in list(wrapper.lora_A.keys()):
        A, B = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
        A_local, B_local = _local_factor("A", A.weight.detach(), shard), _local_factor("B", B.weight.detach(), shard)
        A.weight = nn.Parameter(A_local, requires_grad=A.weight.requires_grad)
        B.weight = nn.Parameter(B_local, requires_grad=B.weight.requires_grad)
        A.out_features, B.in_features = A_local.shape[0], B_local.shape[1]
    wrapper.num_experts = shard.per_rank


def _local_factor(kind: str, full: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """This rank's experts of a full factor, as a new tensor: A [E·r, in] -> rows lo·r:hi·r; B [out, r·E] ->
    view(out, r, E)[:, :, lo:hi] flattened to [out, r·E_local]."""
    E, lo, hi = shard.num_experts, shard.first, shard.first + shard.per_rank
    if kind == "A":
        return full.view(E, -1, full.shape[-1])[lo:hi].reshape(-1, full.shape[-1]).clone()
    return full.view(full.shape[0], -1, E)[:, :, lo:hi].reshape(full.shape[0], -1).clone()


def load_full_lora_state(peft_model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full adapter state (every expert: `lora_state` of an unsharded model, or `gather_expert_lora`) into a
    sharded model, each expert factor cut to this rank's experts; strict on keys and shapes, as `load_lora_state`."""
    sharded = _sharded_keys(peft_model)
    local = {k: _local_factor(sharded[k][0], v, sharded[k][1]) if k in sharded else v for k, v in state.items()}
    load_lora_state(peft_model, local)


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` (an outermost expert ParamWrapper) runs the expert-parallel forward."""
    return hasattr(module, "_mint_expert_shard")


def experts_by_layer(peft_model: nn.Module) -> list[tuple[int, nn.Module]]:
    """The expert-parallel experts modules with their decoder-layer index, in model order (what
    `longstraw.expert_parallel.Lockstep` pads with)."""
    layers = peft_model.get_base_model().model.layers
    owner = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
    return [(owner[id(m)], m) for m in peft_model.modules() if is_sharded(m)]


# ---- forward --------------------------------------------------------------------------------------------------------


def _ep_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    """Installed on the outermost expert ParamWrapper; the experts' forward signature. x [T, H], ids/weights [T, k]."""
    if args or kwargs:
        raise ConfigError(f"expert parallel: unexpected experts arguments {list(kwargs) or len(args)}")
    shard: ExpertShard = self._mint_expert_shard
    wrappers = _wrapper_chain(self)
    adapter = _adapter(wrappers)
    by_param = {w.parameter_name: w for w in wrappers}
    experts = wrappers[-1].base_layer
    T = hidden_states.shape[0]
    x_N_H, offsets_E1, plan = dispatch(hidden_states, top_k_index, shard.group, shard.per_rank)
    y_N_H = local_experts(experts, by_param[GATE_UP], by_param[DOWN], adapter, x_N_H, offsets_E1, plan.local_ends)
    return combine(y_N_H, plan, top_k_weights, T).to(hidden_states.dtype)


def _adapter(wrappers: list[nn.Module]) -> str | None:
    """The adapter to apply, or None for the base experts only (adapters disabled). Merged or several active
    adapters have no sharded form: the full W + ΔW of remote experts is not here."""
    if all(w.disable_adapters for w in wrappers):
        return None
    adapter = _active_adapter(wrappers)
    if adapter is None:
        raise ConfigError("expert parallel: sharded experts run one active, unmerged adapter (or none, disabled)")
    return adapter


def local_experts(
    experts: nn.Module,
    gate_up_lora: nn.Module,
    down_lora: nn.Module,
    adapter: str | None,
    x_N_H: torch.Tensor,
    offsets_E1: torch.Tensor,
    ends: list[int],
) -> torch.Tensor:
    """The unweighted expert outputs of rows sorted by local expert (segment e: rows ends[e]:ends[e+1]). -> [N, H].

        gu = x W_gu[e]^T + s_gu (x A_gu[e]^T) B_gu[e]^T;   h = act(gate) * up
        y  = h W_d[e]^T  + s_d (h A_d[e]^T) B_d[e]^T
    with the LoRA terms omitted when adapter is None. The same per-segment helpers as the unsharded factored path.
    """
    W_gu_E_O_H, W_d_E_H_I = ExpertWeight(experts, GATE_UP), ExpertWeight(experts, DOWN)
    grouped = _grouped_mm_like_transformers(experts, x_N_H) and not W_gu_E_O_H.quantized
    gu_N_O = _segment_linear(x_N_H, W_gu_E_O_H, offsets_E1, ends, grouped)
    if adapter is not None:
        gu_N_O = gu_N_O + _lora(gate_up_lora, adapter, x_N_H, offsets_E1)
    h_N_I = experts._apply_gate(gu_N_O) if hasattr(experts, "_apply_gate") else _default_gate(experts, gu_N_O)
    y_N_H = _segment_linear(h_N_I, W_d_E_H_I, offsets_E1, ends, grouped)
    if adapter is not None:
        y_N_H = y_N_H + _lora(down_lora, adapter, h_N_I, offsets_E1)
    return y_N_H


# ---- export ---------------------------------------------------------------------------------------------------------


def gather_expert_lora(peft_model: nn.Module, group: dist.ProcessGroup | None, *, grads: bool = False, dst: int = 0):
    """The full adapter state, every expert, under PEFT's saved names (as `lora_state` of the unsharded model), on
    group rank `dst` (CPU, contiguous); {} on the other ranks. Every rank of the group must call it.

    grads=True gathers the parameters' .grad instead (zeros where None), for parity tests: expert entries are the
    owners' (every rank's tokens), replicated entries this rank's own (reduce them across ranks first).
    Replicated entries come from `dst` itself.
    """
    state = get_peft_model_state_dict(peft_model)
    adapter = "default"
    if grads:
        params = dict(peft_model.named_parameters())
        state = {k: _grad_of(params[_param_name(k, adapter, params)]) for k in state}
    sharded = _sharded_keys(peft_model)
    rank, global_dst = dist.get_rank(group), dist.get_global_rank(group, dst) if group is not None else dst
    out = {}
    for key in sorted(state):  # the same order on every rank: each gather is one collective
        value = state[key].detach()
        if key in sharded:
            kind, shard = sharded[key]
            parts = [torch.empty_like(value) for _ in range(shard.size)] if rank == dst else None
            dist.gather(value.contiguous(), parts, dst=global_dst, group=group)
            if rank == dst:
                value = _merge(kind, parts, shard)
        if rank == dst:
            out[key] = value.to("cpu").contiguous()
    return out


def _sharded_keys(peft_model: nn.Module) -> dict[str, tuple[str, ExpertShard]]:
    """PEFT saved key -> ("A" | "B", shard) for every sharded expert LoRA factor."""
    keys = {}
    names = {id(m): n for n, m in peft_model.named_modules()}
    for module in peft_model.modules():
        if not is_sharded(module):
            continue
        for wrapper in _wrapper_chain(module):
            prefix = names[id(wrapper)]
            keys[f"{prefix}.lora_A.weight"] = ("A", module._mint_expert_shard)
            keys[f"{prefix}.lora_B.weight"] = ("B", module._mint_expert_shard)
    return keys


def _merge(kind: str, parts: list[torch.Tensor], shard: ExpertShard) -> torch.Tensor:
    """Rank blocks back into PEFT's full layout: A [E·r, in] by rows; B [out, r·E] along the expert axis."""
    if kind == "A":
        return torch.cat(parts, dim=0)
    out = parts[0].shape[0]
    blocks = [p.view(out, -1, shard.per_rank) for p in parts]
    return torch.cat(blocks, dim=2).reshape(out, -1)


def _param_name(key: str, adapter: str, params: dict) -> str:
    """The parameter behind a PEFT saved key, which drops the adapter name (`lora_A.default.weight` is saved as
    `lora_A.weight`)."""
    for suffix in ("weight", "bias"):
        for factor in ("lora_A", "lora_B"):
            tail = f".{factor}.{suffix}"
            if key.endswith(tail):
                name = key[: -len(tail)] + f".{factor}.{adapter}.{suffix}"
                if name in params:
                    return name
    raise KeyError(f"no parameter behind adapter key {key}")


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def expert_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by routed-expert tensors (base stacks, and their LoRA factors), counted by storage: a view of a
    full stack would count the whole stack, so this shows whether the non-local experts were really dropped."""
    seen, base, lora = set(), 0, 0
    for module in model.modules():
        wrappers = _wrapper_chain(module)
        if not wrappers:
            continue
        tensors = [getattr(wrappers[-1].base_layer, GATE_UP), getattr(wrappers[-1].base_layer, DOWN)]
        lora_tensors = [p for w in wrappers for d in (w.lora_A, w.lora_B) for p in d.parameters()]
        for kind, group in (("base", tensors), ("lora", lora_tensors)):
            for t in group:
                storage = t.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                if kind == "base":
                    base += storage.nbytes()
                else:
                    lora += storage.nbytes()
    return {"base": base, "lora": lora}


# ---- loading only the local experts ---------------------------------------------------------------------------------


def load_expert_parallel(
    path: str, group: dist.ProcessGroup | None, lora: LoraConfig, seed: int, dtype: str = "float32"
) -> tuple[nn.Module, dict[str, int]]:
    """The sharded PeftModel that `shard_experts(add_lora(load_model(path, dtype), lora, seed), group)` gives,
    built without a full expert stack: returns (peft_model, bytes read: {"experts", "experts_total", "dense"}).

    The model is built on the meta device (buffers real), the dense weights loaded whole, and each experts module
    gets a full-shape placeholder (one element of storage, stride 0) so PEFT builds the full-size adapter from the
    same seed as the unsharded model; `shard_experts` then cuts the adapter and puts the local rows in, read from
    the checkpoint: per-expert keys (`experts.{e}.gate_proj/up_proj/down_proj.weight`, the hub layout; gate_up[e]
    = cat(gate, up) as transformers fuses them) or fused stacks (`experts.gate_up_proj` [E, 2I, H], read as rows
    lo:hi). Checkpoint keys other than the experts must be the model's own parameter names. An FP8 checkpoint
    (mint.models.quant) stays FP8: its quantized linears become Fp8Linear, and each rank's experts are its FP8 rows
    and block scales (per-expert keys only); an INT4 one (mint.models.quant_int4) stays packed the same way.
    """
    from mint.models.quant_checkpoint import checkpoint_quantization, quantization_config

    torch_dtype = DTYPES[dtype]
    config = AutoConfig.from_pretrained(path)
    block = scheme = None
    kind = checkpoint_quantization(path)
    if kind == "fp8":  # kept FP8, as load_model keeps it (mint.models.quant)
        block = tuple(config.quantization_config["weight_block_size"])
    if kind == "int4":  # kept packed (mint.models.quant_int4)
        scheme = scheme_of(quantization_config(path), path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    experts_names = {}
    for name, module in model.named_modules():
        weights = [getattr(module, p, None) for p in (GATE_UP, DOWN)]
        if all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
            experts_names[id(module)] = name
            for pname, w in zip((GATE_UP, DOWN), weights, strict=True):
                placeholder = torch.zeros((), dtype=torch_dtype).expand(w.shape)
                setattr(module, pname, nn.Parameter(placeholder, requires_grad=False))
    with ExitStack() as stack:
        reader = CheckpointReader(path, stack, torch_dtype, block, scheme)
        reader.quantized_linears(model)
        dense = reader.dense_state()
        result = model.load_state_dict(dense, strict=False, assign=True)
        expert_keys = {f"{n}.{p}" for n in experts_names.values() for p in (GATE_UP, DOWN)}
        tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
        missing = set(result.missing_keys) - expert_keys - tied - reader.taken
        if result.unexpected_keys or missing:
            raise ConfigError(
                f"expert parallel load: {path}: keys the model does not have {sorted(result.unexpected_keys)[:3]}, "
                f"model weights not in the checkpoint {sorted(missing)[:3]}"
            )
        if tied:
            model.tie_weights()
        on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if on_meta:
            raise ConfigError(f"expert parallel load: {path}: left on the meta device: {on_meta[:3]}")
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        peft_model = add_lora(model, lora, seed)
        shard_experts(peft_model, group, lambda m, p, lo, hi: reader.expert_rows(experts_names[id(m)], p, lo, hi))
    return peft_model, {
        "experts": reader.expert_bytes_read,
        "experts_total": reader.expert_bytes_total,
        "dense": reader.dense_bytes_read,
    }
