"""Expert parallel transport: send routed rows to the ranks that own their experts, and bring the outputs back.

Layout: an EP group of `ep` ranks and E = ep · E_local routed experts; rank r owns the contiguous block of experts
[r·E_local, (r+1)·E_local). Every rank brings its own tokens (T may differ per rank, as data-parallel ranks have)
and its own routes ids_T_K, used exactly as given (R3 replays recorded ids upstream, in the router).

    dispatch: each (token t, slot j) pair with expert e = ids[t, j] sends the row x[t] to rank e // E_local. The
              receiver orders what it gets by local expert (then by source rank, then by the source's order), so
              its experts run on contiguous segments, offsets_local [E_local + 1].
    combine:  each output row goes back to the rank and (t, j) it came from; there
                  y[t] = sum_j weights[t, j] · y_pair[t, j]
              so the route weights, and their gradient to the router, stay on the token's rank.

Both are differentiable: the rows travel through one autograd Function whose backward runs the reverse
`all_to_all_single` (the receiver's gradient goes back to the sender), and the permutations around it are plain
indexing. Every rank must call dispatch/combine (and their backward) the same number of times in the same order, as
for any collective; whether the rows require grad must agree across ranks (it does when all ranks run one model).

Communication per layer and rank (b = bytes per element): the per-expert counts, ep · E_local int64 values sent with
a fixed split, and then rows: forward k·T·(H·b_x + O·b_y) bytes, the same again in backward, of which the share
routed to the rank's own experts stays local (copied, not sent). See docs/sharding.md "Expert parallel".

torch.distributed only: works on gloo (CPU) and nccl (GPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from longstraw.errors import LongStrawError


@dataclass
class DispatchPlan:
    """What `dispatch` did, for `combine` to undo. Host lists are per rank of the group; tensors on x's device.

    pairs_P:     flat pair index t·K + j of each row sent, in send order (by global expert); P = sum(send_splits)
    send_splits: rows sent to each rank;  recv_splits: rows received from each rank
    local_perm_N: for each local row (sorted by local expert), its index in the received buffer
    local_ends:  offsets_local on the host, E_local + 1 values
    """

    group: dist.ProcessGroup | None
    num_tokens: int
    top_k: int
    pairs_P: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    local_perm_N: torch.Tensor
    local_ends: list[int]

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def rows_sent_off_rank(self) -> int:
        """Rows this rank sends to other ranks in one direction (forward dispatch, or forward combine reversed)."""
        return sum(self.send_splits) - self.send_splits[self.rank]

    def rows_received_off_rank(self) -> int:
        return sum(self.recv_splits) - self.recv_splits[self.rank]


def dispatch(
    x_T_H: torch.Tensor, ids_T_K: torch.Tensor, group: dist.ProcessGroup | None, experts_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send each routed row to the rank owning its expert. x [T, H]; ids [T, k] global expert ids.

    Returns x_local [N, H] (the rows this rank's experts run, sorted by local expert), offsets_local int64
    [E_local + 1] on x's device (segment e is rows offsets[e]:offsets[e+1]; empty segments are fine), and the plan
    for `combine`. An id equal to E = ep · E_local is transformers' "no expert" sentinel: that slot is skipped and
    contributes 0 (as transformers' own forwards skip it). Ids outside [0, E] raise.
    """
    T, K = ids_T_K.shape
    if x_T_H.shape[0] != T:
        raise LongStrawError(f"dispatch: x has {x_T_H.shape[0]} rows for {T} routed tokens")
    ep = dist.get_world_size(group)
    E = ep * experts_per_rank
    device = x_T_H.device

    # Sort the T·k pairs by global expert once: that groups them by destination rank, and by local expert within
    # each destination, so every rank's block goes out already in the order its receiver needs per source.
    ids_P = ids_T_K.reshape(-1).long()
    order_P = torch.sort(ids_P, stable=True).indices
    counts_E1 = torch.bincount(ids_P, minlength=E + 1)  # raises on negative ids
    if counts_E1.numel() > E + 1:
        raise LongStrawError(
            f"dispatch: expert id {int(ids_P.max())} outside [0, {E}] (E = {ep} ranks x "
            f"{experts_per_rank} experts; {E} is the skip sentinel)"
        )
    send_counts_R_L = counts_E1[:E].view(ep, experts_per_rank)
    recv_counts_R_L = _all_to_all(send_counts_R_L.contiguous(), [1] * ep, [1] * ep, group)
    send_R_L, recv_R_L = send_counts_R_L.cpu(), recv_counts_R_L.cpu()  # the one host sync per layer
    send_splits, recv_splits = send_R_L.sum(1).tolist(), recv_R_L.sum(1).tolist()

    pairs_P = order_P[: sum(send_splits)]  # sentinel pairs sort last and are dropped
    x_recv = _AllToAll.apply(x_T_H[pairs_P // K], recv_splits, send_splits, group)

    # Received rows come in blocks by source rank, each sorted by local expert: a stable sort by local expert makes
    # the segments contiguous, sources in rank order within each.
    local_ids = torch.arange(experts_per_rank).repeat(ep).repeat_interleave(recv_R_L.reshape(-1))
    local_perm_N = torch.sort(local_ids, stable=True).indices.to(device)
    per_expert = recv_R_L.sum(0)
    local_ends = [0, *torch.cumsum(per_expert, 0).tolist()]
    offsets_E1 = torch.tensor(local_ends, dtype=torch.int64, device=device)
    plan = DispatchPlan(group, T, K, pairs_P, send_splits, recv_splits, local_perm_N, local_ends)
    return x_recv[local_perm_N], offsets_E1, plan


def combine(y_local_N_O: torch.Tensor, plan: DispatchPlan, weights_T_K: torch.Tensor, T: int) -> torch.Tensor:
    """Send expert outputs back and sum them per token: y[t] = sum_j weights[t, j] · y_pair[t, j]. -> [T, O].

    y_local [N, O] in the order `dispatch` returned its rows; weights [T, k] are the token's rank's route weights
    (their gradient stays here). Sentinel slots add 0. The sum over k runs in slot order on the rows' dtype promoted
    with the weights' (as transformers' grouped forward does); the caller casts to its hidden dtype.
    """
    if plan.num_tokens != T or tuple(weights_T_K.shape) != (plan.num_tokens, plan.top_k):
        raise LongStrawError(
            f"combine: {T} tokens / weights {tuple(weights_T_K.shape)} for a plan of {plan.num_tokens} x {plan.top_k}"
        )
    inverse_N = torch.empty_like(plan.local_perm_N)
    inverse_N[plan.local_perm_N] = torch.arange(plan.local_perm_N.numel(), device=inverse_N.device)
    y_back_P_O = _AllToAll.apply(y_local_N_O[inverse_N], plan.send_splits, plan.recv_splits, plan.group)
    K, out_dim = plan.top_k, y_back_P_O.shape[-1]
    full_TK_O = y_back_P_O.new_zeros(T * K, out_dim).index_copy(0, plan.pairs_P, y_back_P_O)
    return (full_TK_O.view(T, K, out_dim) * weights_T_K[..., None]).sum(dim=1)


class _AllToAll(torch.autograd.Function):
    """Rows of x go out in blocks of in_splits (one per rank) and arrive in blocks of out_splits; backward sends the
    gradient the reverse way."""

    @staticmethod
    def forward(ctx, x_N_D, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x_N_D, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_M_D):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad_M_D, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x_N_D: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x_N_D.new_empty(sum(out_splits), *x_N_D.shape[1:])
    dist.all_to_all_single(out, x_N_D.contiguous(), out_splits, in_splits, group=group)
    return out
