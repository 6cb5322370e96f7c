"""What the engine needs from an architecture, and the prefix-state types adapters hand back.

The engine never looks inside a prefix state. It asks the adapter to capture one, to run tokens against one, and
(in exact mode) to back-propagate a gradient buffer of the same kind through the prompt. So a new state kind (the
recurrent boundary state of a hybrid model, the compressed latent of GLM-style MLA) is a new adapter with its own
state type; the engine does not change.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import torch


class PrefixState(Protocol):
    """Whatever an adapter captured from the first `length` prompt positions, without autograd."""

    @property
    def length(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def storages(self) -> set[int]:
        """data_ptr of every storage the state owns (the memory meter excludes them from a replay's graph)."""
        ...

    def zeros_like(self, dtype=torch.float32) -> PrefixState:
        """A zero gradient buffer of the same kind (exact mode's dK/dV, fp32 by default)."""
        ...


@dataclass
class KVState:
    """Per-layer K/V of the captured positions: k_L_Hkv_S_D, v_L_Hkv_S_D (post k-norm and RoPE, as attended).

    One allocation per tensor, sized up front to the prompt. The same type holds the exact-mode gradient buffer
    (dK/dV, fp32).
    """

    k_L_Hkv_S_D: torch.Tensor
    v_L_Hkv_S_D: torch.Tensor

    @property
    def length(self) -> int:
        return self.k_L_Hkv_S_D.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_L_Hkv_S_D, self.v_L_Hkv_S_D))

    def storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in (self.k_L_Hkv_S_D, self.v_L_Hkv_S_D)}

    @classmethod
    def empty(cls, layers: int, kv_heads: int, length: int, head_dim: int, dtype, device) -> KVState:
        shape = (layers, kv_heads, length, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def zeros_like(self, dtype=torch.float32) -> KVState:
        return KVState(torch.zeros_like(self.k_L_Hkv_S_D, dtype=dtype), torch.zeros_like(self.v_L_Hkv_S_D, dtype=dtype))


class IntoBuffer(torch.autograd.Function):
    """Identity on a constant prefix tensor x; backward adds x's gradient into the buffer `acc` and returns none.
    `anchor` (any tensor that requires grad) is an input only to put the node in the graph: it runs wherever x's
    gradient is computed (also under torch.autograd.grad over chosen inputs, which would skip a leaf's hook)."""

    @staticmethod
    def forward(ctx, anchor, x, acc):
        ctx.acc = acc
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.acc.add_(g.to(ctx.acc.dtype))
        return None, None, None


@dataclass
class RecurrentState:
    """Per linear-attention layer, the recurrent boundary state after the captured positions: s_L_H_K_V the delta
    rule's state S [L, H_v, d_k, d_v] (fp32, as the recurrence keeps it) and window_L_C_W the causal conv's last W =
    kernel - 1 pre-conv rows [L, conv_dim, W] (the model's dtype). Flat in the prompt length.

    checkpoints: exact mode's states at the start of every capture chunk after the first (the first starts from
    zeros), each a RecurrentState without checkpoints, kept so the prompt backward can recompute a chunk from its
    start; chunk_size is that capture chunk. The same type holds the gradient buffer (dS, dWindow, fp32).
    """

    s_L_H_K_V: torch.Tensor
    window_L_C_W: torch.Tensor
    length: int
    checkpoints: list[RecurrentState] = field(default_factory=list)
    chunk_size: int = 0

    def _tensors(self) -> list[torch.Tensor]:
        own = [self.s_L_H_K_V, self.window_L_C_W]
        return own + [t for c in self.checkpoints for t in c._tensors()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self._tensors()}

    @classmethod
    def zeros(cls, layers: int, heads: int, d_k: int, d_v: int, conv_dim: int, width: int, dtype, device):
        s = torch.zeros((layers, heads, d_k, d_v), dtype=torch.float32, device=device)
        return cls(s, torch.zeros((layers, conv_dim, width), dtype=dtype, device=device), 0)

    def clone(self) -> RecurrentState:
        return RecurrentState(self.s_L_H_K_V.clone(), self.window_L_C_W.clone(), self.length)

    def zeros_like(self, dtype=torch.float32) -> RecurrentState:
        """Zeros of the same shapes, without checkpoints: the gradient buffer (fp32), or with dtype None the state
        of an empty prefix in the state's own dtypes."""
        s, w = self.s_L_H_K_V, self.window_L_C_W
        return RecurrentState(torch.zeros_like(s, dtype=dtype), torch.zeros_like(w, dtype=dtype), self.length)


@dataclass
class LayeredState:
    """A prefix state made of parts keyed by layer type, for decoders that mix layer kinds (a hybrid model's K/V
    pages of its full-attention layers next to the recurrent boundary of its linear-attention layers). Sizes,
    storages and gradient buffers sum over the parts; each part indexes its own layers in model order."""

    parts: dict[str, PrefixState]
    length: int

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts.values())

    def storages(self) -> set[int]:
        return set().union(*(part.storages() for part in self.parts.values()))

    def zeros_like(self, dtype=torch.float32) -> LayeredState:
        return LayeredState({kind: part.zeros_like(dtype) for kind, part in self.parts.items()}, self.length)

    def nbytes_by_kind(self) -> dict[str, int]:
        return {kind: part.nbytes for kind, part in self.parts.items()}


_OPTIONS = ("kernels", "checkpoint_min_tokens", "vocab_limit", "on_positions", "keep_checkpoints", "index_replay")


class Adapter(ABC):
    """Runs one architecture's decoder piecewise: prompt capture, replay against a prefix, prompt backward.

    Positions are absolute: a call over `tokens_T` at `start` covers positions start .. start + T - 1, and the
    prefix state must hold exactly positions 0 .. start - 1. Submodules are the model's own (PEFT-wrapped) modules,
    so LoRA on attention and on fused experts is live, and router hooks (R3) fire as in a plain forward.

    `on_positions(start, T)`, when set, is called before every forward over positions start .. start + T - 1 (R3
    uses it to hand the routers that window's recorded routes). The engine never sets an option on the adapter it
    is given: it runs a copy made by `with_options`, one per phase or micro-batch.
    """

    on_positions = None
    # True where forward() takes a [B, T] batch of responses against one prefix (a replay micro-batch) and
    # replay_graph_bytes estimates its graph; False: the engine replays one response at a time.
    batched_replay = False
    # Which implementation of mint_kernels runs (there is one per op): "auto" Triton for CUDA tensors and the
    # torch reference on CPU; "on" always Triton (CUDA, or CPU under TRITON_INTERPRET=1); "off" always the reference.
    kernels = "auto"
    # Checkpoint each decoder layer in a forward with autograd over at least this many tokens (0: never).
    checkpoint_min_tokens = 0
    # Score only ids below this (a padded LM head's rows past the tokenizer are never sampled); None: all rows.
    vocab_limit = None
    # The engine sets this on the adapter that captures a prompt exact mode will back-propagate through: a state
    # that needs more than its final value for that (a recurrent layer's chunk-start checkpoints) keeps it.
    keep_checkpoints = False
    # DSA's indexer replay (longstraw.adapters.dsa): a callable (layer, start, own selection) -> the selection to
    # attend to, or None. Adapters without an indexer never read it.
    index_replay = None

    def with_options(self, **options) -> Adapter:
        """A copy with `options` (see _OPTIONS) set; self is unchanged.
        The copy shares the model's modules: it costs a dict copy."""
        unknown = [name for name in options if name not in _OPTIONS]
        if unknown:
            raise TypeError(f"unknown adapter options {unknown}; known: {', '.join(_OPTIONS)}")
        twin = copy.copy(self)
        for name, value in options.items():
            setattr(twin, name, value)
        return twin

    def plan_lengths(self, lengths: list[int]) -> list[int]:
        """The response lengths replay micro-batches are planned over: their own. An adapter whose ranks must run the
        same forwards (expert parallel's lockstep) plans over lengths its group agrees on."""
        return lengths

    def replay_graph_bytes(self, rows: int, tokens: int) -> int:
        """Estimated bytes a forward with autograd over `rows` responses of `tokens` tokens saves for backward: what
        sizes replay micro-batches. Needed where `batched_replay` is True."""
        raise NotImplementedError(f"{type(self).__name__} does not estimate its replay graph")

    @abstractmethod
    def capture(self, tokens_S: torch.Tensor, chunk_size: int) -> PrefixState:
        """Prefill positions 0..S-1 in chunks of `chunk_size` without autograd; no logits are computed."""

    @abstractmethod
    def forward(
        self, tokens_T: torch.Tensor, state: PrefixState, grad: PrefixState | None, constant_rows: int
    ) -> torch.Tensor:
        """Final-norm hidden states hidden_T_Hd of tokens at positions state.length .. , with autograd.

        tokens [T], or [B, T] when `batched_replay` (B sequences at the same positions against the one state; the
        hidden states are then [B, T, Hd]).

        grad: a buffer like `state` that receives d(loss)/d(state) during backward (exact mode), or None (the state
        is a constant). constant_rows: the first rows' own state (K/V) is detached, i.e. treated as a constant
        like the prefix (detached mode treats the last prompt position this way).
        """

    @abstractmethod
    def logprobs(self, hidden_T_Hd: torch.Tensor, targets_T: torch.Tensor, temperature: float) -> torch.Tensor:
        """logp_T [T] fp32: log softmax(lm_head(hidden) / temperature)[target], without saving [T, V] logits.
        Leading batch dims pass through: hidden [B, T, Hd], targets [B, T] -> [B, T]."""

    @abstractmethod
    def backward_prompt(
        self,
        tokens_S: torch.Tensor,
        state: PrefixState,
        grad: PrefixState,
        chunk_size: int,
        meter=None,
        backward=None,
    ) -> int:
        """Back-propagate `grad` (d loss / d state) into the LoRA parameters' .grad, chunk by chunk, last first.

        Each chunk's forward is recomputed against the stored state of the earlier chunks, whose gradient
        accumulates into `grad` as the chunk's backward runs; memory is one chunk's graph plus `grad`.
        meter: optional factory of a GraphMeter-like context entered around each chunk's recompute; returns the
        largest chunk graph it measured in bytes (0 without a meter). backward: the engine's backward hook,
        called as backward(scalar, last, True) once per chunk (last for the first chunk, which runs last;
        True: the surrogate carries the framework's loss scale already, see longstraw.engine.Backward).
        """
