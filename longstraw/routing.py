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
`(router_logits, router_weights, router_indices)` with indices `[T, k]` and whose weight rule is in `ROUTER_RULES`:
Qwen2/Qwen3-MoE and Qwen3-Next (softmax, renormalized when norm_topk_prob), Qwen3.5-MoE (softmax, always
renormalized), GLM-4.5 (sigmoid ranked with a score-correction bias and group-limited top-k, weighed unbiased) and
MiniMax-M2 (sigmoid, the bias on its block). Replay recomputes the weights of the replayed ids by each router's own
rule (`replay_weights`); replay refuses a router class without a rule (`check_replayable`), recording takes any.
A router of a known name that returns something else (older transformers releases had GLM's router return logits
only) fails loudly on the first hooked forward instead of recording garbage.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from longstraw.errors import LongStrawError
from longstraw.router_rules import check_replayable, replay_weights

ROUTE_REASONS = ("route_missing", "route_layers", "route_layout", "route_out_of_range", "route_duplicate")

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


class RouteReplay(RouterHooks):
    """R3: make every router use recorded expert ids instead of its own top-k, for the tokens that have a route.

    Usage:
        with RouteReplay(model) as replay:
            replay.set(routes_T_L_K, ok_T)   # T = tokens of the next forward, flattened row-major
            model(input_ids_B_S)
            native_T_L_K = replay.native()    # what the routers would have picked (for the out-of-route ratio)

    For a token with `ok_T` true the experts are the recorded ids; their weights are recomputed from the learner's
    own router logits by the router's own rule (`replay_weights`, `ROUTER_RULES`; a router without one is refused
    here). So the LoRA experts that run are the ones the rollout used, and gradients still reach a trainable router.
    A token with `ok_T` false keeps the router's native choice; the caller gives it weight 0 in the policy gradient
    (it is counted, never silently scored under another path).
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        check_replayable(self.routers)
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


@dataclass
class SequenceRoutes:
    """Recorded routes by absolute position for one prompt and its G responses, for replay in piecewise forwards.

    Prompt positions 0..P-2 read `prompt_routes_S_L_K`; position P-1+j of response i reads row j of its routes
    (the rollout convention: row j is the forward that produced token j). `ok` masks say which rows are usable; the
    others keep native routing. The engine reads windows only (longstraw.replay.route_window) and never writes here.
    """

    prompt_routes_S_L_K: torch.Tensor  # [P-1, L, k] any integer dtype (GroupRoutes stores the id dtype)
    prompt_ok_S: torch.Tensor  # [P-1] bool
    responses: list[tuple[torch.Tensor, torch.Tensor]]  # G x ([R_i, L, k], [R_i] bool), views, never copies
    current: int = 0  # the response `window` reads when it is given none

    def window(self, start: int, n: int, response: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(routes [n, L, k] int64, ok [n]) for positions start .. start + n - 1 of `response` (default `current`).

        Called before every forward, so it touches only the window: a slice of the prompt rows, of the response's
        rows, or both joined over the window. Joining the whole prompt per call cost O(P) per forward (a 16k
        prompt's ids widened to int64 are 50 MB, rebuilt for every chunk).
        """
        routes_R_L_K, ok_R = self.responses[self.current if response is None else response]
        p1 = self.prompt_routes_S_L_K.shape[0]
        end = start + n
        if start < 0 or end > p1 + len(routes_R_L_K):
            total = p1 + len(routes_R_L_K)
            raise LongStrawError(f"routes cover {total} positions, a forward asked for {start}..{end - 1}")
        head, tail = slice(min(start, p1), min(end, p1)), slice(max(start, p1) - p1, max(end, p1) - p1)
        if tail.start == tail.stop:
            return self.prompt_routes_S_L_K[head].long(), self.prompt_ok_S[head]
        if head.start == head.stop:
            return routes_R_L_K[tail].long(), ok_R[tail]
        routes = torch.cat([self.prompt_routes_S_L_K[head].long(), routes_R_L_K[tail].long()])
        return routes, torch.cat([self.prompt_ok_S[head], ok_R[tail]])


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
    rows = routes_N_L_K.shape[0] if routes_N_L_K is not None and routes_N_L_K.dim() > 0 else -1
    reason = _whole_reason(routes_N_L_K, rows, num_tokens, layout, recorded_experts)
    if reason is not None:
        return status_N.fill_(_CODE[reason])
    return _row_status(routes_N_L_K, layout.num_experts)


_CODE = {reason: i + 1 for i, reason in enumerate(ROUTE_REASONS)}


def _whole_reason(
    probe: torch.Tensor | None, rows: int, num_tokens: int, layout: ExpertLayout, recorded_experts: int | None = None
) -> str | None:
    """The reason a whole record fails, or None. `probe` has the record's rank, trailing shape and dtype (the
    record itself, or a few rows of it); `rows` is the record's length."""
    if probe is None or probe.dim() != 3 or rows != num_tokens:
        return "route_missing"
    if probe.shape[1] != layout.num_layers:
        return "route_layers"
    integer = not (probe.is_floating_point() or probe.is_complex() or probe.dtype == torch.bool)
    if probe.shape[2] != layout.top_k or not integer or recorded_experts not in (None, layout.num_experts):
        return "route_layout"
    return None


def _row_status(routes_N_L_K: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-row status (0, route_out_of_range or route_duplicate) of a record that passed `_whole_reason`."""
    status_N = torch.zeros(routes_N_L_K.shape[0], dtype=torch.long)
    ids = routes_N_L_K.long()
    out_of_range_N = ((ids < 0) | (ids >= num_experts)).flatten(1).any(1)
    sorted_ids = ids.sort(dim=-1).values
    duplicate_N = (sorted_ids[..., 1:] == sorted_ids[..., :-1]).flatten(1).any(1)
    status_N[duplicate_N] = _CODE["route_duplicate"]
    status_N[out_of_range_N] = _CODE["route_out_of_range"]
    return status_N


def _id_dtype(layout: ExpertLayout) -> torch.dtype:
    """The smallest integer dtype that holds every expert id: the rollout's route_dtype (uint8 up to 256 experts,
    int16 above) while int16 holds it, int32 past 32768 experts."""
    return layout.route_dtype if layout.num_experts <= 2**15 else torch.int32


def _record_reason(prompt, recorded, p1: int, n: int, layout: ExpertLayout) -> str | None:
    """`route_status`'s whole-record reason for prompt [P-1, L, k] + recorded [R, L, k] joined, without joining them.

    Only the first row of each is joined: torch.cat's rank, shape and dtype-promotion rules (a float response makes
    the whole record float) give the same verdict on one row as on all. A pair that does not join, or whose prompt
    and response lengths are not P-1 and R (a shifted record), is missing, never a crash.
    """
    try:
        probe = torch.cat([prompt[:1], recorded[:1]])
        aligned = prompt.shape[0] == p1 and recorded.shape[0] == n
    except (RuntimeError, TypeError, IndexError, AttributeError):
        return "route_missing"
    return _whole_reason(probe, p1 + n if aligned else -1, p1 + n, layout)


@dataclass
class GroupRoutes:
    """R3 bookkeeping for one prompt and its G responses: which positions replay which recorded route.

    Positions are absolute. The prompt has P tokens; the rollout recorded routes for prompt positions 0..P-2
    (`prompt_routes_P1_L_K`) and, per response, one row per generated token (row j = the forward at position P-1+j
    that produced token j). A response's sequence is prompt + response[:-1], so it has P-1+R_i positions.

    Storage: the prompt's rows once and each response's rows once (back to back in one [N = sum R_i, L, k] buffer),
    in the smallest integer dtype that holds the expert ids; rows that are not ok are zeros. P=16384, L=48, k=8,
    G=8, R=256: 7.1 MB held, where G int64 copies of prompt + response were 409 MB (docs/mismatch.md).

    Two views of the same routes, built per call:
      padded()      the naive step's one [G, S] batch (S = P + R_max - 1, rows right-padded), flattened to [G*S]
      sequence()    LongStraw's piecewise forwards: prompt rows once, then response i's rows by position; its
                    window(start, n) widens only the window to int64
    status_G gives every response token's route status (0 = mappable, see ROUTE_REASONS); a token whose status is
    not 0 keeps native routing and is excluded by the trust mask.
    """

    status_G: list[torch.Tensor]  # G x int64 [R_i]
    prompt_routes_P1_L_K: torch.Tensor  # [P-1, L, k] id dtype; zeros where prompt_ok_P1 is False
    prompt_ok_P1: torch.Tensor  # bool [P-1]: the prompt position replays (some response's record is usable)
    routes_N_L_K: torch.Tensor  # [N = sum R_i, L, k] id dtype, response i at rows offset_i .. offset_i + R_i - 1
    ok_N: torch.Tensor  # bool [N]
    usable_G: list[bool]  # response i's whole record passed (R3 on): its padded row replays the prompt rows too
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
        """Check each response's record (prompt + response, as one) against `layout` and store the usable rows.

        replay=False (R3 off) still computes the statuses (for the out-of-route measurement) but marks nothing ok,
        so every router runs natively. A payload that does not even concatenate counts as missing, never a crash.
        The prompt's per-row checks run once, not once per response: its rows are the same in every record.
        """
        p1, dtype = num_prompt - 1, _id_dtype(layout)
        shape_L_K = (layout.num_layers, layout.top_k)
        prompt_S_L_K = torch.zeros(p1, *shape_L_K, dtype=dtype)
        routes_N_L_K = torch.zeros(sum(lengths), *shape_L_K, dtype=dtype)
        ok_N = torch.zeros(sum(lengths), dtype=torch.bool)
        prompt_status_S, statuses, usable_G, offset = None, [], [], 0
        for i, n in enumerate(lengths):
            recorded = routes_G[i] if routes_G is not None else None
            reason = _record_reason(prompt_routes_P1_L_K, recorded, p1, n, layout)
            if reason is not None:
                statuses.append(torch.full((n,), _CODE[reason], dtype=torch.long))
            else:
                if prompt_status_S is None:  # reshape: a 1-D empty prompt (P=1) joins as no rows
                    prompt_status_S = _row_status(prompt_routes_P1_L_K.reshape(p1, *shape_L_K), layout.num_experts)
                statuses.append(_row_status(recorded, layout.num_experts))
            usable_G.append(replay and reason is None)
            if usable_G[-1]:
                ok_R = statuses[-1] == 0
                routes_N_L_K[offset : offset + n][ok_R] = recorded[ok_R].to(dtype)
                ok_N[offset : offset + n] = ok_R
            offset += n
        prompt_ok_S = torch.zeros(p1, dtype=torch.bool)
        if any(usable_G):
            prompt_ok_S = prompt_status_S == 0
            prompt_S_L_K[prompt_ok_S] = prompt_routes_P1_L_K.reshape(p1, *shape_L_K)[prompt_ok_S].to(dtype)
        return cls(statuses, prompt_S_L_K, prompt_ok_S, routes_N_L_K, ok_N, usable_G, num_prompt, list(lengths))

    @property
    def seq_len(self) -> int:
        return self.num_prompt + max(self.lengths) - 1

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held: routes, ok masks, statuses."""
        held = [self.prompt_routes_P1_L_K, self.prompt_ok_P1, self.routes_N_L_K, self.ok_N, *self.status_G]
        return sum(t.nbytes for t in held)

    def _responses(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """G x (routes [R_i, L, k], ok [R_i]): views of the one buffer."""
        bounds = list(itertools.accumulate(self.lengths, initial=0))
        return [(self.routes_N_L_K[a:b], self.ok_N[a:b]) for a, b in itertools.pairwise(bounds)]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(routes_T_L_K int64, ok_T) for the padded [G, S] batch flattened row-major, as RouteReplay.set takes them.

        Built per call: the naive step feeds G x S tokens in one forward anyway, so [G*S] ids are the size of its
        input. A response whose record is unusable has zeros (not ok) in its prompt rows too.
        """
        p1, num_rows = self.num_prompt - 1, len(self.lengths)
        routes_G_S_L_K = torch.zeros(num_rows, self.seq_len, *self.routes_N_L_K.shape[1:], dtype=torch.long)
        ok_G_S = torch.zeros(num_rows, self.seq_len, dtype=torch.bool)
        for i, (routes_R_L_K, ok_R) in enumerate(self._responses()):
            if self.usable_G[i]:
                routes_G_S_L_K[i, :p1] = self.prompt_routes_P1_L_K
                ok_G_S[i, :p1] = self.prompt_ok_P1
            routes_G_S_L_K[i, p1 : p1 + len(ok_R)] = routes_R_L_K
            ok_G_S[i, p1 : p1 + len(ok_R)] = ok_R
        return routes_G_S_L_K.flatten(0, 1), ok_G_S.flatten()

    def response_rows(self, rows_T_L_K: torch.Tensor, i: int) -> torch.Tensor:
        """Response i's producing positions (P-1 .. P+R_i-2) out of a padded [G*S] flattening (e.g. native routes)."""
        first = i * self.seq_len + self.num_prompt - 1
        return rows_T_L_K[first : first + self.lengths[i]]

    def sequence(self) -> SequenceRoutes:
        """The same routes by absolute position for LongStraw's capture, replays and prompt backward; no copies.

        The prompt rows replay wherever some response's record is usable (they are the same rows in every record).
        """
        return SequenceRoutes(self.prompt_routes_P1_L_K, self.prompt_ok_P1, self._responses())
