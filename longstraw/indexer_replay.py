"""DSA indexer replay: the learner attends to the keys the rollout's indexer selected, as R3 routes to the rollout's
experts.

A DSA layer's selection is a top-k of index scores, and scores a hair apart in the rollout engine and the learner
(another kernel, another batch shape, bf16 against fp32) can swap keys at the cut, or ReLU ties at 0 go another
way. Then the learner scores the sampled tokens under a sparsity pattern the rollout never used. Replay removes
that: per response, the rollout records each response query's selection per indexer layer, and the learner's
response forwards attend to it instead of their own. Prompt positions keep the learner's own selection (recording
them would cost P x layers x index_topk indices per prompt). The mismatch count says how often the two differed.

Records: per response, [R, I, K] integers, row j the query at absolute position P-1+j (the forward that produced
token j, the route convention), slice i the i-th layer that owns an indexer (model order), K = index_topk, absolute
key positions with -1 in empty slots. Off by default: at DeepSeek-V3.2's dims a response token's record is 61 x 2048
int32 = 488 KiB (`mint plan` states the total).
"""

from __future__ import annotations

from functools import partial

import torch

from longstraw.errors import LongStrawError

__all__ = ["IndexerReplay"]


class IndexerReplay:
    """The records of one update's responses (None for a response without one), and the counts: `replayed` query x
    layer pairs the policy replays attended to a recorded selection, `mismatched` of those where the learner's own
    selection differed (as a set of keys)."""

    def __init__(self, records: list[torch.Tensor | None], lengths: list[int], prompt_len: int, index_slot: dict):
        if len(records) != len(lengths):
            raise LongStrawError(f"indexer replay: {len(records)} records for {len(lengths)} responses")
        for i, (record, length) in enumerate(zip(records, lengths, strict=True)):
            if record is not None and (record.dim() != 3 or record.shape[:2] != (length, len(index_slot))):
                raise LongStrawError(
                    f"indexer replay: response {i}'s record is {tuple(record.shape)}, expected [{length}, "
                    f"{len(index_slot)}, index_topk] (its tokens x the model's indexer layers)"
                )
        self.records = records
        self.start = prompt_len - 1  # where the response forwards begin
        self.slot = index_slot
        self.replayed = torch.zeros((), dtype=torch.int64)
        self.mismatched = torch.zeros((), dtype=torch.int64)

    def for_rows(self, rows: list[int], count: bool = True):
        """The adapter's `index_replay` for a forward over responses `rows` (one row, or a [len(rows), T] batch);
        count=False replays without counting (the reference pass)."""
        return partial(self._choose, rows, count)

    def _choose(self, rows: list[int], count: bool, layer: int, start: int, own: torch.Tensor) -> torch.Tensor:
        if start != self.start:
            return own  # a prompt chunk
        t, k = own.shape[-2:]
        own_B = own.reshape(len(rows), t, k)
        chosen = own_B.clone()
        for b, i in enumerate(rows):
            record = self.records[i]
            if record is None:
                continue
            n = min(t, record.shape[0])  # a batch row's pads past its response keep their own selection
            recorded = record[:n, self.slot[layer]].to(own.device, torch.int64)
            if recorded.shape[-1] != k:
                raise LongStrawError(f"indexer replay: records keep {recorded.shape[-1]} keys per query, the model {k}")
            if count:
                differ = (own_B[b, :n].sort(-1).values != recorded.sort(-1).values).any(-1)
                self.replayed += n
                self.mismatched += differ.sum().cpu()
            chosen[b, :n] = recorded
        return chosen.reshape(own.shape)
