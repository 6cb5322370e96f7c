"""Find the top-k routers of a sparse-MoE model and hook them: record routes now, replay them later (R3).

A "route" of one token at one MoE layer is the k expert ids its router picked, in the router's own order (topk
order, highest probability first). Routes of a forward over T tokens (T = batch * seq, flattened row-major the way
the MoE block flattens its input) stack to `routes_T_L_K`, L = MoE layers in model order.

Every hook lives only inside a `with` block and is removed on exit, exceptions included, so a model outside one is
the plain model. `RouterHooks` holds that lifecycle; `RouteRecorder` is the recording subclass. A replaying subclass
(the learner's R3) overrides the same `_on_router_output` and returns a replacement `(logits, scores, indices)`:
PyTorch uses a forward hook's non-None return value as the module's output.

Supported routers are the transformers 5.x `*TopKRouter` / `*TopkRouter` modules whose forward returns
`(router_logits, router_scores, router_indices)` with indices `[T, k]` (Qwen3-MoE, Qwen2-MoE, and kin). A router of
that name that returns something else (GLM-4.5's returns logits only; its block picks experts) is found but fails
loudly on the first hooked forward instead of recording garbage.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from longstraw.errors import LongStrawError

# Matched case-insensitively against the class name: transformers spells both "TopKRouter" and "TopkRouter".
_ROUTER_CLASS_SUFFIX = "topkrouter"


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router modules of `model` in layer order.

    Works through a PEFT wrapper: `modules()` walks into the wrapped base model, and wrappers (LoRA layers,
    ParamWrapper) have their own class names, so a router is never counted twice. Registration order of
    `model.layers` is layer order. Raises LongStrawError when there is none (a dense model).
    """
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith(_ROUTER_CLASS_SUFFIX)]
    if not routers:
        raise LongStrawError(
            f"no top-k router found in {type(model).__name__}: route recording needs a sparse-MoE model whose "
            "routers are *TopKRouter modules (transformers >= 5)"
        )
    return routers


class RouterHooks:
    """Forward hooks on every router of a model, alive only inside `with`.

    Subclasses implement `_on_router_output(layer, module, output)`; returning None keeps the router's output,
    returning a value replaces it.
    """

    def __init__(self, model: nn.Module):
        self.routers = find_routers(model)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def __enter__(self):
        if self._handles:
            raise LongStrawError(f"{type(self).__name__} is already active; it cannot be entered twice")
        try:
            for layer, router in enumerate(self.routers):
                hook = functools.partial(self._hook, layer)
                self._handles.append(router.register_forward_hook(hook))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int, module: nn.Module, args, output):
        return self._on_router_output(layer, module, output)

    def _on_router_output(self, layer: int, module: nn.Module, output):
        raise NotImplementedError


def router_indices(module: nn.Module, output) -> torch.Tensor:
    """The `[T, k]` expert ids out of a router's output `(logits, scores, indices)`; LongStrawError otherwise."""
    if not (isinstance(output, tuple) and len(output) == 3 and isinstance(output[2], torch.Tensor)):
        raise LongStrawError(
            f"{type(module).__name__} returned {type(output).__name__}, not (logits, scores, indices): "
            "this router family is not supported by route recording yet"
        )
    indices_T_K = output[2]
    if indices_T_K.dim() != 2:
        shape = tuple(indices_T_K.shape)
        raise LongStrawError(f"{type(module).__name__} returned indices of shape {shape}, not [T, k]")
    return indices_T_K


class RouteRecorder(RouterHooks):
    """Record the expert ids every router picks, per forward.

    Usage:
        with RouteRecorder(model) as recorder:
            model(input_ids_B_S)
            routes_B_S_L_K = recorder.pop_batched(B, S)

    Indices stay on the model's device (no host sync per layer); the caller moves them once. Hooks run under
    whatever grad mode the forward runs in; the indices are integer tensors and carry no graph.
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._pending: list[list[torch.Tensor]] = [[] for _ in self.routers]

    def _on_router_output(self, layer: int, module: nn.Module, output):
        self._pending[layer].append(router_indices(module, output).detach())
        return None

    def clear(self) -> None:
        for per_layer in self._pending:
            per_layer.clear()

    def pop(self) -> torch.Tensor:
        """Routes of the latest forward, `[T, L, k]` int64, T = batch * seq flattened row-major; then clear.

        "Latest" because a caller may run forwards it does not want recorded (e.g. a warmup) without popping.
        """
        missing = [layer for layer, per_layer in enumerate(self._pending) if not per_layer]
        if missing:
            raise LongStrawError(f"no routes recorded for MoE layers {missing}; no forward since the last pop?")
        latest_L = [per_layer[-1] for per_layer in self._pending]
        self.clear()
        num_tokens = {indices_T_K.shape for indices_T_K in latest_L}
        if len(num_tokens) != 1:
            raise LongStrawError(f"routers disagree on the routed shape: {sorted(num_tokens)}")
        return torch.stack(latest_L, dim=1).long()

    def pop_batched(self, batch: int, seq: int) -> torch.Tensor:
        """Routes of the latest forward over `[batch, seq]` inputs, as `[batch, seq, L, k]` int64; then clear."""
        routes_T_L_K = self.pop()
        if routes_T_L_K.shape[0] != batch * seq:
            raise LongStrawError(f"recorded {routes_T_L_K.shape[0]} routed tokens, expected {batch} x {seq}")
        return routes_T_L_K.view(batch, seq, *routes_T_L_K.shape[1:])
