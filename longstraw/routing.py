"""Find the top-k routers of a sparse-MoE model and hook them: record routes now, replay them later (R3).

A "route" of one token at one MoE layer is the k expert ids its router picked, in the router's own order (Qwen:
highest probability first; GLM: unsorted top-k). Order carries no meaning: a route is a set, and replay weighs
each id by itself. Routes of a forward over T tokens (T = batch * seq, flattened row-major the way
the MoE block flattens its input) stack to `routes_T_L_K`, L = MoE layers in model order.

Every hook lives only inside a `with` block and is removed on exit, exceptions included, so a model outside one is
the plain model. `RouterHooks` holds that lifecycle; `RouteRecorder` is the recording subclass. A replaying subclass
(the learner's R3) overrides the same `_on_router_output` and returns a replacement `(logits, scores, indices)`:
PyTorch uses a forward hook's non-None return value as the module's output.

Supported routers are the transformers 5.x `*TopKRouter` / `*TopkRouter` modules whose forward returns
`(router_logits, router_weights, router_indices)` with indices `[T, k]`: Qwen3-MoE, Qwen2-MoE and kin (softmax
routing), and GLM-4.5 (`Glm4MoeTopkRouter`: sigmoid routing with a score-correction bias and group-limited top-k,
which picks the experts inside the router in the installed transformers). Replay recomputes the weights of the
replayed ids by each router's own rule (`replay_weights`). A router of that name that returns something else (older
transformers releases had GLM's router return logits only and its block pick the experts) is found but fails loudly
on the first hooked forward instead of recording garbage; so does replay on a biased router whose rule is unverified.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from longstraw.errors import LongStrawError

ROUTE_REASONS = ("route_missing", "route_layers", "route_layout", "route_out_of_range", "route_duplicate")

# Matched case-insensitively against the class name: transformers spells both "TopKRouter" and "TopkRouter".
_ROUTER_CLASS_SUFFIX = "topkrouter"
# Routers that score experts by sigmoid, rank them by score + e_score_correction_bias within the best groups, and weigh
# them by the unbiased scores (GLM-4.5's `Glm4MoeTopkRouter.forward`, transformers 5.x); see `replay_weights`.
_SIGMOID_ROUTERS = ("Glm4MoeTopkRouter",)
# GLM's router adds this to the top-k sum before dividing (transformers' Glm4MoeTopkRouter); kept for bit-equal weights.
_SIGMOID_NORM_EPS = 1e-20


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


class RouteReplay(RouterHooks):
    """R3: make every router use recorded expert ids instead of its own top-k, for the tokens that have a route.

    Usage:
        with RouteReplay(model) as replay:
            replay.set(routes_T_L_K, ok_T)   # T = tokens of the next forward, flattened row-major
            model(input_ids_B_S)
            native_T_L_K = replay.native()    # what the routers would have picked (for the out-of-route ratio)

    For a token with `ok_T` true the experts are the recorded ids; their weights are recomputed from the learner's own
    router logits by the router's own rule (`replay_weights`: softmax for Qwen-MoE, unbiased sigmoid times
    routed_scaling_factor for GLM-4.5). So the LoRA experts that run are the ones the rollout used, and gradients
    still reach a trainable router. A token with `ok_T` false keeps the router's native choice; the caller gives it
    weight 0 in the policy gradient (it is counted, never silently scored under another path).
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._routes_T_L_K: torch.Tensor | None = None
        self._ok_T: torch.Tensor | None = None
        self._native: list[torch.Tensor | None] = [None] * len(self.routers)

    def set(self, routes_T_L_K: torch.Tensor, ok_T: torch.Tensor) -> None:
        if routes_T_L_K.dim() != 3 or routes_T_L_K.shape[1] != self.num_layers:
            raise LongStrawError(f"routes must be [T, {self.num_layers}, k], got {tuple(routes_T_L_K.shape)}")
        self._routes_T_L_K = routes_T_L_K.long()
        self._ok_T = ok_T.bool()

    def native(self) -> torch.Tensor:
        """The routers' own top-k ids `[T, L, k]` from the latest forward."""
        if any(n is None for n in self._native):
            raise LongStrawError("no replayed forward yet")
        return torch.stack(self._native, dim=1)

    def _on_router_output(self, layer: int, module: nn.Module, output):
        native_T_K = router_indices(module, output)
        self._native[layer] = native_T_K.detach()
        if self._routes_T_L_K is None:
            raise LongStrawError("RouteReplay.set(routes, ok) must be called before each forward")
        logits_T_E = output[0]
        routes_T_K = self._routes_T_L_K[:, layer].to(native_T_K.device)
        if routes_T_K.shape != native_T_K.shape:
            raise LongStrawError(
                f"layer {layer}: routes {tuple(routes_T_K.shape)} for {tuple(native_T_K.shape)} tokens"
            )
        ok_T = self._ok_T.to(native_T_K.device)
        ids_T_K = torch.where(ok_T[:, None], routes_T_K, native_T_K)
        return logits_T_E, replay_weights(module, logits_T_E, ids_T_K), ids_T_K


def replay_weights(router: nn.Module, logits_T_E: torch.Tensor, ids_T_K: torch.Tensor) -> torch.Tensor:
    """weights_T_K that `router` gives experts `ids_T_K`, from its logits_T_E, by the rule it uses for its own top-k.

    Softmax routers (Qwen3-MoE, Qwen2-MoE):
        w = softmax(logits)[ids], then w / sum(w) when norm_topk_prob.
    Sigmoid routers (GLM-4.5): s = sigmoid(logits). The router picks its top-k by s + e_score_correction_bias within
    its best topk_group of n_group groups, but the bias and the groups only rank; the weights are
        w = s[ids], then w / (sum(w) + 1e-20) when norm_topk_prob, then w * routed_scaling_factor.
    For the router's own ids this is its own output; for replayed ids it is what it would have weighed them with.
    Returned in the logits' dtype (fp32 for GLM, whose router computes in fp32), with autograd to the router.
    """
    name = type(router).__name__
    if name in _SIGMOID_ROUTERS:
        scores_T_E = logits_T_E.float().sigmoid()
        weights_T_K = scores_T_E.gather(-1, ids_T_K)
        if router.norm_topk_prob:
            weights_T_K = weights_T_K / (weights_T_K.sum(dim=-1, keepdim=True) + _SIGMOID_NORM_EPS)
        weights_T_K = weights_T_K * router.routed_scaling_factor
    elif hasattr(router, "e_score_correction_bias"):
        raise LongStrawError(
            f"{name} ranks experts with a score-correction bias but its weight rule is not verified for route "
            f"replay; supported biased routers: {', '.join(_SIGMOID_ROUTERS)}"
        )
    else:
        probs_T_E = torch.softmax(logits_T_E.float(), dim=-1)
        weights_T_K = probs_T_E.gather(-1, ids_T_K)
        if getattr(router, "norm_topk_prob", False):
            weights_T_K = weights_T_K / weights_T_K.sum(dim=-1, keepdim=True)
    return weights_T_K.to(logits_T_E.dtype)


@dataclass
class SequenceRoutes:
    """Recorded routes by absolute position for one prompt and its G responses, for replay in piecewise forwards.

    Prompt positions 0..P-2 read `prompt_routes_S_L_K`; position P-1+j of response `current` reads row j of its
    routes (the rollout convention: row j is the forward that produced token j). `ok` masks say which rows are
    usable; the others keep native routing.
    """

    prompt_routes_S_L_K: torch.Tensor  # [P-1, L, k]
    prompt_ok_S: torch.Tensor  # [P-1] bool
    responses: list[tuple[torch.Tensor, torch.Tensor]]  # G x ([R_i, L, k], [R_i] bool)
    current: int = 0
    replay: RouteReplay | None = None  # set by the engine while it replays; .native() reads the latest forward

    def window(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(routes [n, L, k], ok [n]) for positions start .. start + n - 1."""
        routes_R_L_K, ok_R = self.responses[self.current]
        routes = torch.cat([self.prompt_routes_S_L_K.long(), routes_R_L_K.long()])
        ok = torch.cat([self.prompt_ok_S, ok_R])
        if start + n > len(routes):
            raise LongStrawError(f"routes cover {len(routes)} positions, a forward asked for {start}..{start + n - 1}")
        return routes[start : start + n], ok[start : start + n]


@dataclass(frozen=True)
class ExpertLayout:
    """A model's routed experts: what route recording, replay and the route checks need to know. One type for the
    whole tree (mint.models.specs.moe_layout builds it from a config)."""

    num_layers: int  # MoE layers, in model order
    num_experts: int
    top_k: int
    # Where the MoE layers sit among all decoder layers. vLLM and SGLang return one route row per decoder layer,
    # dense ones included (zeros there), so reading their routes needs both; None: every decoder layer is MoE.
    layer_ids: tuple[int, ...] | None = None  # decoder-layer index of each MoE layer; None: range(num_layers)
    num_decoder_layers: int | None = None  # all decoder layers; None: num_layers

    def __post_init__(self):
        ids, total = self.moe_layer_ids, self.decoder_layers
        increasing = all(a < b for a, b in itertools.pairwise(ids))
        if len(ids) != self.num_layers or not increasing or any(i < 0 or i >= total for i in ids):
            raise LongStrawError(
                f"ExpertLayout: layer_ids {ids} are not {self.num_layers} increasing decoder-layer indices "
                f"below {total}"
            )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The decoder-layer index of each MoE layer, in model order."""
        return tuple(self.layer_ids) if self.layer_ids is not None else tuple(range(self.num_layers))

    @property
    def decoder_layers(self) -> int:
        """All decoder layers, dense ones included: the L of an engine's routes (vLLM, SGLang)."""
        return self.num_decoder_layers if self.num_decoder_layers is not None else self.num_layers

    @property
    def route_dtype(self) -> torch.dtype:
        """uint8 ids while they fit (<= 256 experts), else int16: routes are [R, L, k] per response."""
        return torch.uint8 if self.num_experts <= 256 else torch.int16


def route_status(
    routes_N_L_K: torch.Tensor | None, num_tokens: int, layout: ExpertLayout, recorded_experts: int | None = None
) -> torch.Tensor:
    """Per-token route status: 0 = mappable, else 1 + index into ROUTE_REASONS. Returns int64 [num_tokens].

    routes_N_L_K: the recorded ids for the N positions the learner replays (or None); recorded_experts: the expert
    count the rollout engine declared, when it did. Never raises on a bad payload: bad payloads are counted.
    """
    status_N = torch.zeros(num_tokens, dtype=torch.long)
    code = {reason: i + 1 for i, reason in enumerate(ROUTE_REASONS)}
    if routes_N_L_K is None or routes_N_L_K.dim() != 3 or routes_N_L_K.shape[0] != num_tokens:
        return status_N.fill_(code["route_missing"])
    if routes_N_L_K.shape[1] != layout.num_layers:
        return status_N.fill_(code["route_layers"])
    integer = not (routes_N_L_K.is_floating_point() or routes_N_L_K.is_complex() or routes_N_L_K.dtype == torch.bool)
    if (
        routes_N_L_K.shape[2] != layout.top_k
        or not integer
        or (recorded_experts is not None and recorded_experts != layout.num_experts)
    ):
        return status_N.fill_(code["route_layout"])
    ids = routes_N_L_K.long()
    out_of_range_N = ((ids < 0) | (ids >= layout.num_experts)).flatten(1).any(1)
    sorted_ids = ids.sort(dim=-1).values
    duplicate_N = (sorted_ids[..., 1:] == sorted_ids[..., :-1]).flatten(1).any(1)
    status_N[duplicate_N] = code["route_duplicate"]
    status_N[out_of_range_N] = code["route_out_of_range"]
    return status_N


@dataclass
class GroupRoutes:
    """R3 bookkeeping for one prompt and its G responses: which positions replay which recorded route.

    Positions are absolute. The prompt has P tokens; the rollout recorded routes for prompt positions 0..P-2
    (`prompt_routes_P1_L_K`) and, per response, one row per generated token (row j = the forward at position P-1+j
    that produced token j). A response's sequence is prompt + response[:-1], so it has P-1+R_i positions.

    Two views of the same routes:
      padded()      the naive step's one [G, S] batch (S = P + R_max - 1, rows right-padded), flattened to [G*S]
      sequence()    LongStraw's piecewise forwards: prompt rows once, then response i's rows by position
    status_G gives every response token's route status (0 = mappable, see ROUTE_REASONS); a token whose status is
    not 0 keeps native routing and is excluded by the trust mask.
    """

    status_G: list[torch.Tensor]  # G x int64 [R_i]
    routes_G_S_L_K: torch.Tensor  # int64; rows with ok False are zeros
    ok_G_S: torch.Tensor  # bool: position replays its recorded route
    num_prompt: int
    lengths: list[int]

    @classmethod
    def build(
        cls,
        prompt_routes_P1_L_K: torch.Tensor | None,
        routes_G: list[torch.Tensor | None] | None,
        num_prompt: int,
        lengths: list[int],
        layout: ExpertLayout,
        replay: bool,
    ) -> GroupRoutes:
        """Check each response's record against `layout` and lay the usable ones out by position.

        replay=False (R3 off) still computes the statuses (for the out-of-route measurement) but marks nothing ok,
        so every router runs natively. A payload that does not even concatenate counts as missing, never a crash.
        """
        seq_len = num_prompt + max(lengths) - 1
        routes_G_S_L_K = torch.zeros(len(lengths), seq_len, layout.num_layers, layout.top_k, dtype=torch.long)
        ok_G_S = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
        statuses = []
        for i, n in enumerate(lengths):
            recorded = routes_G[i] if routes_G is not None else None
            full = None
            if prompt_routes_P1_L_K is not None and recorded is not None:
                try:
                    full = torch.cat([prompt_routes_P1_L_K, recorded])
                except (RuntimeError, TypeError):
                    full = None
            status_S = route_status(full, num_prompt - 1 + n, layout)
            statuses.append(status_S[num_prompt - 1 :])
            if replay and full is not None:
                ok = status_S == 0
                routes_G_S_L_K[i, : len(ok)][ok] = full[ok].long()
                ok_G_S[i, : len(ok)] = ok
        return cls(statuses, routes_G_S_L_K, ok_G_S, num_prompt, list(lengths))

    @property
    def seq_len(self) -> int:
        return self.routes_G_S_L_K.shape[1]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(routes_T_L_K, ok_T) for the padded [G, S] batch flattened row-major, as RouteReplay.set takes them."""
        return self.routes_G_S_L_K.flatten(0, 1), self.ok_G_S.flatten()

    def response_rows(self, rows_T_L_K: torch.Tensor, i: int) -> torch.Tensor:
        """Response i's producing positions (P-1 .. P+R_i-2) out of a padded [G*S] flattening (e.g. native routes)."""
        first = i * self.seq_len + self.num_prompt - 1
        return rows_T_L_K[first : first + self.lengths[i]]

    def sequence(self) -> SequenceRoutes:
        """The same routes by absolute position for LongStraw's capture, replays and prompt backward."""
        p1 = self.num_prompt - 1
        responses = [
            (self.routes_G_S_L_K[i, p1 : p1 + n], self.ok_G_S[i, p1 : p1 + n]) for i, n in enumerate(self.lengths)
        ]
        # Prompt rows are identical in every row whose record is usable; take them from the first such row.
        prompt_ok_G_S = self.ok_G_S[:, :p1]
        source = int(prompt_ok_G_S.any(1).float().argmax())
        return SequenceRoutes(self.routes_G_S_L_K[source, :p1], prompt_ok_G_S[source], responses)
