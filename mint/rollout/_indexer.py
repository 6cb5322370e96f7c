"""Recording the DSA indexer's selections during a rollout (see "Indexer convention" in mint/rollout/engine.py).

Each DSA attention layer with its own lightning indexer (`layer.self_attn.indexer`; None on a GLM-5 "shared" layer,
which reuses the previous layer's selection) returns from its forward the top-k key columns per query, [B, S, K_hf]
int32 with K_hf = min(index_topk, key columns). `IndexerRecorder` hooks those modules for the length of one decode
batch, keeps each forward's outputs, and turns the last query's selection into absolute key positions:

    key column c of a row with `pad` left-padding columns is absolute position c - pad (prefill: the chunk's columns,
    pad = chunk width - prompt length; decode: the slab's, pad = P_max - prompt length)

The last query of a forward sees every column written so far and no future one, so the only columns it can select
that hold no real key are its row's pads (c < pad), which HF's topk returns when the row has fewer than K real keys;
they become -1, as do the slots past K_hf when fewer than K columns exist. Each row is then sorted ascending, so the
-1s come first.
"""

from __future__ import annotations

import torch
from torch import nn

from mint.errors import MintError


def find_indexers(model: nn.Module) -> list[nn.Module]:
    """The indexer modules of `model` (PEFT-wrapped or not), in model order: every `indexer` submodule that is set."""
    return [module.indexer for module in model.modules() if isinstance(getattr(module, "indexer", None), nn.Module)]


def checked_indexers(model: nn.Module) -> list[nn.Module]:
    """`find_indexers`, refusing a model without any or whose indexers do not all keep config.index_topk keys."""
    indexers = find_indexers(model)
    if not indexers:
        raise MintError(f"rollout: record_indexer needs a DSA model; {type(model).__name__} has no indexer modules")
    top_k = getattr(model.config, "index_topk", None)
    if any(getattr(m, "index_topk", None) != top_k for m in indexers):
        raise MintError(f"rollout: the indexers' index_topk differ from config.index_topk = {top_k}")
    return indexers


def absolute_selection(columns_B_I_K: torch.Tensor, pad_B: torch.Tensor, top_k: int) -> torch.Tensor:
    """Key columns [B, I, K_hf] of each row's last query -> absolute positions [B, I, top_k] int32, sorted ascending.

    positions = columns - pad_B (pad columns, negative after the shift, become -1); slots past K_hf are -1."""
    positions = columns_B_I_K.long() - pad_B[:, None, None].long()
    positions = positions.clamp(min=-1)
    missing = top_k - positions.shape[-1]
    if missing > 0:
        positions = torch.cat([positions, positions.new_full((*positions.shape[:2], missing), -1)], dim=-1)
    return positions.sort(dim=-1).values.to(torch.int32)


class IndexerRecorder:
    """Forward hooks on every indexer, for one decode batch of B rows x N tokens (a context manager: hooks exist only
    inside `with`). The engine calls `prefill` after each prefill forward and `decode` after each decode forward;
    `selections()` gives the [B, N, I, K] buffer (row j of a completion = the forward that produced token j)."""

    def __init__(self, indexers: list[nn.Module], top_k: int, source_B: torch.Tensor, max_tokens: int):
        self.indexers, self.top_k, self.source_B = indexers, top_k, source_B
        shape = (source_B.numel(), max_tokens, len(indexers), top_k)
        self.selections_B_N_I_K = torch.full(shape, -1, dtype=torch.int32, device=source_B.device)
        self.first_D_I_K: torch.Tensor | None = None  # per distinct prompt, the prefill's last query (row 0)
        self._outputs: list[torch.Tensor | None] = [None] * len(indexers)
        self._handles: list = []

    def __enter__(self) -> IndexerRecorder:
        for index, module in enumerate(self.indexers):
            self._handles.append(module.register_forward_hook(self._hook(index)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def hook(module, args, output):
            self._outputs[index] = output

        return hook

    def _pop_last(self, pad_B: torch.Tensor) -> torch.Tensor:
        """The last forward's selections at its last query, as absolute positions [B, I, K]."""
        if any(output is None for output in self._outputs):
            raise MintError("rollout: an indexer did not run in the last forward; its selection cannot be recorded")
        columns_B_I_K = torch.stack([output[:, -1] for output in self._outputs], dim=1)
        self._outputs = [None] * len(self.indexers)
        return absolute_selection(columns_B_I_K, pad_B, self.top_k)

    def prefill(self, chunk_S: torch.Tensor, pad_S: torch.Tensor, num_prompts: int) -> None:
        """After a prefill forward of distinct prompts chunk_S [S] with left pads pad_S [S]: their row 0."""
        first_S_I_K = self._pop_last(pad_S)
        if self.first_D_I_K is None:
            self.first_D_I_K = first_S_I_K.new_full((num_prompts, *first_S_I_K.shape[1:]), -1)
        self.first_D_I_K[chunk_S] = first_S_I_K

    def decode(self, active_R: torch.Tensor, row: int, pad_R: torch.Tensor) -> None:
        """After the decode forward that produces token `row` for the batch rows active_R [R] (pads pad_R [R])."""
        self.selections_B_N_I_K[active_R, row] = self._pop_last(pad_R)

    def selections(self) -> torch.Tensor:
        """[B, N, I, K] int32 on the engine's device; rows past a completion's length are meaningless."""
        self.selections_B_N_I_K[:, 0] = self.first_D_I_K[self.source_B]
        return self.selections_B_N_I_K
