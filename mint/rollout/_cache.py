"""The rollout engine's KV cache: one preallocated slab per layer, written in place, never concatenated.

Hugging Face's DynamicCache grows by `torch.cat` at every forward, so a decode of N tokens copies the whole cache N
times per layer (O(N^2) bytes moved). `KVSlab` allocates `[B, H_kv, C, D]` keys and values per layer once, for the
longest prompt plus the decode (C = P_max + max_tokens - 1), writes each forward's new columns in place and hands
attention a view of the columns written so far.

Layout (shared by every row of the decode batch):

    columns 0 .. P_max-1      the prompts, RIGHT-aligned (left padding): row b's prompt of P_b tokens sits in
                              columns P_max-P_b .. P_max-1; the columns before it are zeros or a pad token's K/V,
                              masked out by the engine's attention mask
    columns P_max + j         the token fed at decode step j (the same column for every row)

All rows advance together, so one integer `length` per layer is the whole bookkeeping and transformers' mask builder
sizes its masks from it (`get_mask_sizes`). Rows can leave the batch (`batch_select_indices`, one copy of the kept
rows); rows never join. Only full-attention layers are supported: a sliding-window or linear-attention layer would
need its own slab logic, and `KVSlab` refuses such a config by name.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from mint.errors import MintError


class _SlabLayer(CacheLayerMixin):
    """One attention layer's K/V slab `[B, H_kv, C, D]`; allocated at the first write (its heads, head dim, dtype and
    device come from the model's own K/V), zero-filled so masked columns hold finite values."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, rows: int, capacity: int):
        super().__init__()
        self.rows, self.capacity = rows, capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, k_dim = key_states.shape
        shape_k = (self.rows, heads, self.capacity, k_dim)
        shape_v = (self.rows, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.device = key_states.device
        self.keys = torch.zeros(shape_k, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(shape_v, dtype=value_states.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the forward's new columns [B, H, S, D] at `length` and return views of columns 0 .. length+S-1."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity or key_states.shape[0] != self.keys.shape[0]:
            raise MintError(
                f"rollout KV cache: a forward of {tuple(key_states.shape)} does not fit the slab "
                f"{tuple(self.keys.shape)} at column {self.length}"
            )
        self.keys[:, :, self.length : end].copy_(key_states)
        self.values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write_rows(self, keys_S_H_L_D, values_S_H_L_D, rows_R, source_R, column: int) -> None:
        """Copy prefill state into the slab: slab row rows_R[i] gets source row source_R[i] in columns column ..
        column+L-1. Several slab rows may read one source row (a prompt's G samples)."""
        if not self.is_initialized:
            self.lazy_initialization(keys_S_H_L_D, values_S_H_L_D)
        end = column + keys_S_H_L_D.shape[-2]
        self.keys[rows_R, :, column:end] = keys_S_H_L_D[source_R]
        self.values[rows_R, :, column:end] = values_S_H_L_D[source_R]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only slab rows `indices` (one copy of those rows' columns written so far, into a smaller slab)."""
        if not self.is_initialized:
            self.rows = int(indices.numel())
            return
        kept_k = self.keys.new_zeros((indices.numel(), *self.keys.shape[1:]))
        kept_v = self.values.new_zeros((indices.numel(), *self.values.shape[1:]))
        kept_k[:, :, : self.length] = self.keys[indices, :, : self.length]
        kept_v[:, :, : self.length] = self.values[indices, :, : self.length]
        self.keys, self.values, self.rows = kept_k, kept_v, int(indices.numel())


class KVSlab(Cache):
    """A preallocated KV cache for `rows` sequences of at most `capacity` columns, for every layer of `config`."""

    def __init__(self, config, rows: int, capacity: int):
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise MintError(
                f"rollout: the built-in engine's KV cache supports full-attention layers only; this model has {other}"
            )
        super().__init__(layers=[_SlabLayer(rows, capacity) for _ in layer_types])

    @property
    def rows(self) -> int:
        return self.layers[0].rows

    def write_prefill(self, prefill: Cache, rows_R: torch.Tensor, source_R: torch.Tensor, column: int) -> None:
        """Copy every layer of a finished prefill cache (rows = distinct prompts) into slab rows `rows_R`."""
        if len(prefill.layers) != len(self.layers):
            raise MintError(f"rollout KV cache: prefill has {len(prefill.layers)} layers, the slab {len(self.layers)}")
        for slab, layer in zip(self.layers, prefill.layers, strict=True):
            slab.write_rows(layer.keys, layer.values, rows_R, source_R, column)

    def set_length(self, length: int) -> None:
        """Mark columns 0 .. length-1 as written (after `write_prefill` filled the prompt columns)."""
        for layer in self.layers:
            if length > layer.capacity:
                raise MintError(f"rollout KV cache: length {length} exceeds the capacity {layer.capacity}")
            layer.length = length
