"""Context parallel in the learner (`longstraw.context_parallel` = C > 1; docs/sharding.md, "Context parallel in the
learner"): which ranks form a CP group, and how a step's plans reach them.

The N learner ranks make D = N / C data-parallel replicas. With expert parallel EP (consecutive ranks, the layout
DeepSpeed's expert groups use), the ranks come in blocks of EP·C consecutive ranks, and inside block b rank
b·EP·C + c·EP + e (c < C, e < EP) works for replica b·EP + e. So CP group (b, e) is {b·EP·C + e + c·EP : c < C}:
its C ranks run the same prompt groups, micro-step for micro-step, each keeping its pages of every captured prompt
(longstraw.context_parallel). A block is the unit placement keeps on one node (mint.train.placement), so CP and EP
traffic stay inside it; the EP groups of a block ({b·EP·C + c·EP + e : e < EP}, one per c) hold the same EP replicas,
so the lockstep padding of CP peers agrees. With N = EP·C (one block) this is the strided layout {j, j + D, ...}.

Gradients: every rank of a CP group ends with the whole gradient of its replica's loss (the CP library's rule), so
each rank weighs its loss by D, not N; DeepSpeed's mean over all N ranks then gives the sum over the D replicas.
"""

from __future__ import annotations

import torch

__all__ = ["cp_group_ranks", "data_parallel_size", "new_cp_group", "replica_of", "replicate_plans"]


def data_parallel_size(world_size: int, context_parallel: int) -> int:
    """D: the number of replicas working on different prompt groups."""
    return world_size // context_parallel


def replica_of(rank: int, context_parallel: int, expert_parallel: int = 1) -> int:
    """The replica (0..D-1) that `rank` works for."""
    block, offset = divmod(rank, context_parallel * expert_parallel)
    return block * expert_parallel + offset % expert_parallel


def cp_group_ranks(world_size: int, context_parallel: int, expert_parallel: int = 1) -> list[list[int]]:
    """The CP groups in replica order; group d holds the ranks of replica d, its first rank the replica's reporter."""
    unit = context_parallel * expert_parallel
    return [
        [b * unit + e + c * expert_parallel for c in range(context_parallel)]
        for b in range(world_size // unit)
        for e in range(expert_parallel)
    ]


def new_cp_group(rank: int, world_size: int, context_parallel: int, expert_parallel: int = 1):
    """This rank's CP process group (collective: every rank of the default group calls it, creating every group in
    the same order, as torch.distributed requires)."""
    mine = None
    for ranks in cp_group_ranks(world_size, context_parallel, expert_parallel):
        group = torch.distributed.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def replicate_plans(plans: list, world_size: int, context_parallel: int, expert_parallel: int = 1) -> list:
    """One plan per rank from the D replicas' plans: rank r gets its replica's, the same object as its CP peers."""
    return [plans[replica_of(r, context_parallel, expert_parallel)] for r in range(world_size)]
