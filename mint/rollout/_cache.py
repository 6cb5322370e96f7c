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
rows); rows never join.

A linear-attention layer (the Gated DeltaNet layers of Qwen3.5 / Qwen3-Next, `config.layer_types`) has no columns:
it keeps a fixed-size state per row, preallocated for the B rows by `_SlabLinearLayer` (transformers'
`LinearAttentionLayer`, so the model reads and writes it through the same Cache calls as its own cache):

    conv state       [B, conv_dim, K]        the last K inputs of the causal conv (HF's width: the decode kernel
                                             concatenates the new column, convolves, and keeps the last K again)
    recurrent state  [B, H_v, d_k, d_v]      the delta-rule state, fp32 as the model returns it

The prefill's states are copied into every row that samples that prompt. Left padding needs no column bookkeeping
here: the model zeroes padded inputs before these layers, so a state stays exactly zero through a row's pads. Each
decode step updates both states in place (one copy each, as HF's own cache). Sliding-window and other layer types
would need their own slab logic, and `KVSlab` refuses such a config by name.

Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash) caches through the same K/V slab: its "keys" are the
normalized latent `[B, 1, C, kv_lora_rank]` and its "values" the shared RoPE key `[B, 1, C, qk_rope_head_dim]` (one
head, two widths; attention expands them through kv_b_proj at every forward). The DSA families (DeepSeek-V3.2, GLM-5:
`config.layer_types` "indexed_attention") add the lightning indexer's per-token keys, one more column slab per layer,
`_SlabIndexedLayer`:

    indexer keys     [B, C, index_head_dim]  single-head, written by `update_indexer` in the same columns as the
                                             latent; a layer that reuses another's selection (GLM-5 "shared") never
                                             writes it and it stays unallocated

The indexer scores its query against columns 0 .. length-1 under the same attention mask as the latent, so a row's
left padding is masked out of the selection too.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer, get_layer_types_and_kwargs

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


class _SlabIndexedLayer(_SlabLayer):
    """A DSA layer: the latent slab of `_SlabLayer` plus the indexer's keys `[B, C, index_head_dim]`, allocated at
    their first write. transformers' `StaticIndexedLayer` preallocates the same buffer but hands the indexer all C
    columns, sized for its own full-width static masks; the engine's masks are `length` columns wide
    (`get_mask_sizes`), so this layer hands a view of the columns written so far, as `_SlabLayer.update` does.

    The attention writes the latent (`update`) before its indexer writes its keys (`update_indexer`), so the indexer
    keeps its own column count; both equal `length` between forwards."""

    def __init__(self, rows: int, capacity: int):
        super().__init__(rows, capacity)
        self.indexer_keys: torch.Tensor | None = None
        self.indexer_length = 0

    def _allocate_indexer(self, keys_S_L_D: torch.Tensor) -> None:
        shape = (self.rows, self.capacity, keys_S_L_D.shape[-1])
        self.indexer_keys = torch.zeros(shape, dtype=keys_S_L_D.dtype, device=keys_S_L_D.device)

    def update_indexer(self, keys_B_S_D: torch.Tensor) -> torch.Tensor:
        """Write the forward's new indexer keys [B, S, D] at `indexer_length`; return columns 0 .. its new end."""
        if self.indexer_keys is None:
            self._allocate_indexer(keys_B_S_D)
        end = self.indexer_length + keys_B_S_D.shape[1]
        if end > self.capacity or keys_B_S_D.shape[0] != self.indexer_keys.shape[0]:
            raise MintError(
                f"rollout KV cache: indexer keys of {tuple(keys_B_S_D.shape)} do not fit the slab "
                f"{tuple(self.indexer_keys.shape)} at column {self.indexer_length}"
            )
        self.indexer_keys[:, self.indexer_length : end].copy_(keys_B_S_D)
        self.indexer_length = end
        return self.indexer_keys[:, :end]

    def write_indexer_rows(self, keys_S_L_D: torch.Tensor, rows_R, source_R, column: int) -> None:
        """Copy a prefill's indexer keys: slab row rows_R[i] gets source row source_R[i] in columns column .. +L-1."""
        if self.indexer_keys is None:
            self._allocate_indexer(keys_S_L_D)
        self.indexer_keys[rows_R, column : column + keys_S_L_D.shape[1]] = keys_S_L_D[source_R]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only slab rows `indices` of the latent and of the indexer keys."""
        super().batch_select_indices(indices)
        if self.indexer_keys is not None:
            kept = self.indexer_keys.new_zeros((indices.numel(), *self.indexer_keys.shape[1:]))
            kept[:, : self.indexer_length] = self.indexer_keys[indices, : self.indexer_length]
            self.indexer_keys = kept


class _SlabLinearLayer(LinearAttentionLayer):
    """One linear-attention layer's per-row states, conv `[B, conv_dim, K]` and recurrent `[B, H_v, d_k, d_v]`;
    allocated at the first `write_rows` (shapes past the row, dtypes and device come from the prefill's states).

    The decode runs transformers' own `LinearAttentionLayer` paths on these tensors: the model's single-token conv
    update writes `conv_states[0]` in place, and `update_recurrent_state` copies the new state into
    `recurrent_states[0]`. A forward whose batch is not the slab's rows fails in the conv's concatenation here, and
    in every full-attention layer's `update` (every hybrid has one)."""

    def __init__(self, rows: int):
        super().__init__(number_of_states=1)
        self.rows = rows

    def write_rows(self, conv_S_C_K, recurrent_S_H_K_V, rows_R, source_R) -> None:
        """Copy prefill states into the slab: slab row rows_R[i] gets source row source_R[i] of both states."""
        if not self.is_conv_states_initialized[0]:
            # Expanded views: lazy_initialization reads only their shape, dtype and device, and allocates zeros.
            self.lazy_initialization(
                conv_states=conv_S_C_K[:1].expand(self.rows, *conv_S_C_K.shape[1:]),
                recurrent_states=recurrent_S_H_K_V[:1].expand(self.rows, *recurrent_S_H_K_V.shape[1:]),
                conv_kernel_size=conv_S_C_K.shape[-1],
            )
        self.conv_states[0][rows_R] = conv_S_C_K[source_R]
        self.recurrent_states[0][rows_R] = recurrent_S_H_K_V[source_R]
        self.has_previous_state[0] = True

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only slab rows `indices` (one copy of those rows' states)."""
        if self.is_conv_states_initialized[0]:
            self.conv_states[0] = self.conv_states[0][indices]
            self.recurrent_states[0] = self.recurrent_states[0][indices]
        self.rows = int(indices.numel())


def row_state_columns(config, dtype_bytes: int) -> int:
    """How many K/V columns hold as many bytes as one row's linear-attention states (0 for a model without them).

    The engine budgets a decode batch in slab slots, rows x columns, which counts what grows with a row's length.
    A hybrid row also holds a fixed state per linear layer, the conv window [conv_dim, K] in the model dtype and the
    recurrent state [H_v, d_k, d_v] in fp32, and at real dims that is thousands of columns' worth (Qwen3.5-35B-A3B:
    about 62 MiB per row against 20 KiB per column of its 10 full layers' K/V), so the engine counts each row as
    this many extra columns. dtype_bytes: the model's (K/V and the conv window)."""
    text = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text)
    linear = layer_types.count("linear_attention")
    if not linear:
        return 0
    column = layer_types.count("full_attention") * 2 * text.num_key_value_heads * text.head_dim * dtype_bytes
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    value_dim = text.linear_num_value_heads * text.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * text.linear_conv_kernel_dim * dtype_bytes
    recurrent = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    return -(-linear * (conv + recurrent) // column)


class KVSlab(Cache):
    """A preallocated cache for `rows` sequences of at most `capacity` columns, for every layer of `config`: a K/V
    slab per full-attention layer (the latent per MLA layer), the latent and indexer keys per DSA layer, per-row
    states per linear-attention layer."""

    def __init__(self, config, rows: int, capacity: int):
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        kinds = set(layer_types)
        hybrid = kinds <= {"full_attention", "linear_attention"} and "full_attention" in kinds
        if not hybrid and kinds != {"indexed_attention"}:
            raise MintError(
                "rollout: the built-in engine's KV cache supports full-attention layers, optionally interleaved with "
                f"linear-attention layers, or DSA's indexed-attention layers; this model has {sorted(kinds)}"
            )
        slab = {
            "linear_attention": _SlabLinearLayer,
            "full_attention": _SlabLayer,
            "indexed_attention": _SlabIndexedLayer,
        }
        super().__init__(
            layers=[slab[t](rows) if t == "linear_attention" else slab[t](rows, capacity) for t in layer_types]
        )

    @property
    def rows(self) -> int:
        return self.layers[0].rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns written, read off a layer with columns: a linear-attention layer has none, so for one (a hybrid's
        layer 0) the first full-attention layer answers. The model reads this for the new tokens' positions.
        transformers 5.25 answers with layer 0's own count, on a linear layer a token counter that the slab's copied
        prefill states never advance: a hybrid decoded from position 0 again (greedy tokens off HF's from the
        second one; up to 17 nats between rollout and learner). 5.24 skipped linear layers, as this does."""
        if isinstance(self.layers[layer_idx], _SlabLinearLayer):
            layer_idx = next(i for i, layer in enumerate(self.layers) if not isinstance(layer, _SlabLinearLayer))
        return self.layers[layer_idx].get_seq_length()

    def write_prefill(self, prefill: Cache, rows_R: torch.Tensor, source_R: torch.Tensor, column: int) -> None:
        """Copy every layer of a finished prefill cache (rows = distinct prompts) into slab rows `rows_R`."""
        if len(prefill.layers) != len(self.layers):
            raise MintError(f"rollout KV cache: prefill has {len(prefill.layers)} layers, the slab {len(self.layers)}")
        for slab, layer in zip(self.layers, prefill.layers, strict=True):
            if isinstance(slab, _SlabLinearLayer):
                slab.write_rows(layer.conv_states[0], layer.recurrent_states[0], rows_R, source_R)
            else:
                slab.write_rows(layer.keys, layer.values, rows_R, source_R, column)
            if isinstance(slab, _SlabIndexedLayer) and layer.is_indexer_initialized:
                slab.write_indexer_rows(layer.indexer_keys, rows_R, source_R, column)

    def set_length(self, length: int) -> None:
        """Mark columns 0 .. length-1 as written (after `write_prefill` filled the prompt columns)."""
        for layer in self.layers:
            if isinstance(layer, _SlabLinearLayer):
                continue  # no columns: its state is the whole prompt's
            if length > layer.capacity:
                raise MintError(f"rollout KV cache: length {length} exceeds the capacity {layer.capacity}")
            layer.length = length
            if isinstance(layer, _SlabIndexedLayer):
                layer.indexer_length = length
