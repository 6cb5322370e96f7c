"""Replay: the G responses scored against one captured prefix, in micro-batches sized by a memory budget.

A micro-batch is one forward and one backward over B responses of the group, right-padded to the longest of them
(T tokens): a [B, T] batch at positions P-1 .. P+T-2 against the one prefix state. The prefix is shared, so the batch
axis is on the response side only: attention reads each prefix K/V block once for all B rows
(`mint_kernels.prefix_attention` takes q [B, H, T, D] against a [H_kv, S, D] prefix), and exact mode's dK/dV
buffer receives the sum over the rows.

Padding, and why it changes nothing: the pads sit after each row's own tokens, so causal attention never shows
them to a real position; routers and experts treat every token on its own (no capacity limit); and the pad
positions are cut from the logprobs before the objective sees them. So a pad's output reaches no loss, its
backward carries a zero gradient, and it adds exactly 0 to every LoRA gradient and to dK/dV. What differs from
one-at-a-time replay is only the order of fp32 sums (tests/test_replay_batch.py bounds it).

How many per micro-batch: the adapter estimates the bytes a forward over B rows of T tokens saves for backward
(`Adapter.replay_graph_bytes`); responses join a micro-batch, longest first, while that estimate stays within the
budget. Budget 0, or one below a single response's estimate, is serial replay in the responses' own order: one
response per forward, the path this engine always had.

Responses long enough for per-layer checkpointing (`checkpoint_min_tokens`) replay alone. A checkpointed forward
keeps only each layer's input, and its backward recomputes one layer at a time: batched, that recompute would hold
B rows' layer at once, the memory checkpointing exists to save, and no saved-tensor meter sees it (measured: a P=16384
detached update whose micro-batches of 256-token rows peaked 1.35x its metered bound, against 1.125 serially). Long
rows also gain least from batching: what a micro-batch saves is the fixed cost of a forward, which their own tokens
already amortize.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from longstraw.adapters import Adapter, PrefixState
from longstraw.routing import RouteReplay, SequenceRoutes

# The token id in pad positions: any id the embedding holds; nothing reads what it produces.
PAD_ID = 0


def plan_micro_batches(
    lengths: list[int],
    budget_bytes: int,
    graph_bytes: Callable[[int, int], int],
    batched: bool = True,
    alone_from: int = 0,
) -> list[list[int]]:
    """Response indices per micro-batch. graph_bytes(B, T): estimated bytes saved for backward by B rows of T tokens.

    With a budget (and `batched`), responses are taken longest first (stable), so a micro-batch pads to its first
    row, and one joins the current micro-batch while graph_bytes(B + 1, T_first) <= budget_bytes; a response of at
    least `alone_from` tokens (> 0: the checkpointing threshold) is a micro-batch of its own. Otherwise, or for a
    budget below one response, every response is its own micro-batch, in order.
    """
    if budget_bytes <= 0 or not batched:
        return [[i] for i in range(len(lengths))]
    short = (lambda n: n < alone_from) if alone_from > 0 else (lambda n: True)
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        first = lengths[batches[-1][0]] if batches else 0
        if batches and short(first) and graph_bytes(len(batches[-1]) + 1, first) <= budget_bytes:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def score_response(
    adapter: Adapter,
    tokens_P: torch.Tensor,
    response_R: torch.Tensor,
    state: PrefixState,
    grad: PrefixState | None,
    constant_rows: int,
    temperature: float,
) -> torch.Tensor:
    """logp_R [R] fp32 of `response_R` after the prompt, run against `state` (positions 0..P-2).

    The forward covers [t_{P-1}, r_0 .. r_{R-2}]: row j predicts r_j. r_{R-1} is never fed (nothing reads its output).
    """
    inputs_T = torch.cat([tokens_P[-1:], response_R[:-1]])
    hidden_T_Hd = adapter.forward(inputs_T, state, grad, constant_rows)
    return adapter.logprobs(hidden_T_Hd, response_R, temperature)


def score_responses(
    adapter: Adapter,
    tokens_P: torch.Tensor,
    responses: list[torch.Tensor],
    state: PrefixState,
    grad: PrefixState | None,
    constant_rows: int,
    temperature: float,
) -> list[torch.Tensor]:
    """`score_response` for B responses in one forward: B x logp [R_b] fp32, with autograd when grad mode is on.

    Row b of the [B, T = max R_b] batch is [t_{P-1}, r_b[0] .. r_b[R_b - 2]] and then pads; its logprobs are
    logp_B_T[b, :R_b]. One response takes `score_response`'s 1-D path unchanged.
    """
    if len(responses) == 1:
        return [score_response(adapter, tokens_P, responses[0], state, grad, constant_rows, temperature)]
    t = max(int(r.shape[0]) for r in responses)
    inputs_B_T = tokens_P.new_full((len(responses), t), PAD_ID)
    targets_B_T = tokens_P.new_full((len(responses), t), PAD_ID)
    inputs_B_T[:, 0] = tokens_P[-1]
    for b, response_R in enumerate(responses):
        inputs_B_T[b, 1 : response_R.shape[0]] = response_R[:-1]
        targets_B_T[b, : response_R.shape[0]] = response_R
    hidden_B_T_Hd = adapter.forward(inputs_B_T, state, grad, constant_rows)
    logp_B_T = adapter.logprobs(hidden_B_T_Hd, targets_B_T, temperature)
    return [logp_B_T[b, : r.shape[0]] for b, r in enumerate(responses)]


def route_window(routes: SequenceRoutes, rows: list[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes [B * n, L, k] int64, ok [B * n]) for positions start .. start + n - 1 of responses `rows`, flattened
    row-major as the MoE blocks flatten a [B, n] batch. A row's positions past its own sequence (pads) are not ok:
    they route natively. A window inside the prompt is the same for every response."""
    if len(rows) == 1:
        return routes.window(start, n, response=rows[0])
    p1 = routes.prompt_routes_S_L_K.shape[0]
    ids, oks = [], []
    for i in rows:
        own = min(n, p1 + len(routes.responses[i][1]) - start)
        ids_n, ok_n = routes.window(start, own, response=i)
        ids.append(torch.cat([ids_n, ids_n.new_zeros(n - own, *ids_n.shape[1:])]))
        oks.append(torch.cat([ok_n, ok_n.new_zeros(n - own)]))
    return torch.cat(ids), torch.cat(oks)


def positions_hook(hooks: RouteReplay | None, routes: SequenceRoutes | None, rows: list[int]):
    """The adapter's `on_positions` for forwards over responses `rows` (or the prompt, rows [0]): hands the routers
    the recorded routes of each window (R3). None without routes."""
    if hooks is None or routes is None:
        return None
    return lambda start, n: hooks.set(*route_window(routes, rows, start, n))


def native_routes(hooks: RouteReplay, lengths: list[int]) -> list[torch.Tensor]:
    """The routers' own picks in the latest forward over a [B, max(lengths)] batch, per row: B x [R_b, L, k]."""
    native_T_L_K = hooks.native()
    native_B_T_L_K = native_T_L_K.view(len(lengths), -1, *native_T_L_K.shape[1:])
    return [native_B_T_L_K[b, :n] for b, n in enumerate(lengths)]
