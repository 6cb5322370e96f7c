"""The built-in rollout engine: all of a step's groups in one decode batch, each distinct prompt prefilled once.

It runs on a plain Hugging Face causal LM or a PEFT-wrapped one (expert LoRA runs factored when the model was built
by `mint.models.lora.add_lora`), records what the learner needs to score the same tokens the same way, and returns
picklable `GroupRollout`s (they cross Ray).

Phases (STYLE 6), for `generate(prompts, G, params, seed)` with B = len(prompts) x G rows, group-major:
    layout   the distinct prompts (a prompt given twice is prefilled once), P_max, and which prompt each row decodes;
             one `KVSlab` (mint/rollout/_cache.py) of B rows x (P_max + max_tokens - 1) columns per attention layer
             (a linear-attention layer: a fixed-size state per row) is allocated up front and written in place: no
             per-step concatenation, no per-group cache copies (a step whose slab would pass `max_batch_tokens` slots
             runs as several such batches, one after the other, groups of similar prompt length together)
    prefill  the distinct prompts, shortest first, in left-padded batches of at most `prefill_tokens` padded tokens
             (P token-forwards per prompt, not G x P); each batch's K/V is copied right-aligned (its linear-attention
             states as they are) into the slab rows of every group that samples that prompt
    decode   one forward of [B, 1] per step for every row of every group: a left-padded row is masked up to its
             prompt and fed its own positions (P_b + j). A group leaves the batch once all its G rows are done; the
             slab is compacted (one copy of the kept rows) when finished groups hold a quarter of its rows
The naive alternative, G copies of each prompt through prefill, costs G x P prompt token-forwards instead of P;
the retired bench/rollout_prefix.py measured that (docs/benchmarks.md); bench/rollout_throughput.py compares the
whole engine with batched HF generate.

Logprob convention
    `logprobs_R[j] = longstraw.scoring.token_logprobs(logits_j, tokens_R[j], T)`, i.e. log softmax(logits / T) at the
    sampled token, in fp32, where logits_j are the logits that produced token j. Top-p truncation is a sampling device
    and NOT part of the scored policy (vLLM and verl report logprobs the same way), so a token kept by top-p has the
    logprob of the untruncated tempered distribution. Greedy decoding (T = 0) records logprobs at T = 1. The learner
    calls the same `token_logprobs`, so the two sides score identically by construction.

Route convention (R3)
    Route row j of a completion is the routing computed in the forward pass that PRODUCED token j, i.e. the routing
    of the input at absolute position P-1+j (row 0 comes from the prefill's last position, row j >= 1 from decode
    step j, whose input is token j-1). The prompt routes cover prompt positions 0..P-2 (a left-padded prefill's
    pad columns are dropped). So cat(prompt_routes_P1_L_K, routes_R_L_K) has P+R-1 rows and lines up exactly with
    the positions a learner feeds (prompt + response[:-1]) to score the response. Routes use
    `ExpertLayout.route_dtype` (uint8 while <= 256 experts); they are None for a dense model.

Indexer convention (DSA, with `record_indexer=True`)
    Row j of `indexer_R_I_K` is, like route row j, the forward that produced token j (the query at absolute position
    P-1+j): per indexer layer (those whose self_attn.indexer is set, in model order; a GLM-5 "shared" layer reuses
    the previous one's), the K = config.index_topk keys its lightning indexer selected, as ABSOLUTE positions
    0..P-1+j sorted ascending (`row.sort().values`), with -1 in the slots HF's topk spent on a left pad column or that
    do not exist (fewer than K keys); the -1s sort first. Recorded by forward hooks (mint/rollout/_indexer.py) during
    the call only; without `record_indexer` the field is None and nothing is hooked.

Stopping
    A row stops at the first eos id (from the engine) or stop id (from SamplingParams); that token IS kept as the last
    token, because the learner must train the model to emit it. A finished row keeps being fed while any row of its
    group runs (its group's draws stay rectangular); what it samples afterwards is discarded. A group whose rows are
    all done leaves the batch; the loop ends when every group is done or after max_tokens.

Determinism and batching
    Group i draws from its own generator, seeded with `group_seed(seed, i)` (group 0: `seed` itself), G draws per
    step while the group is in the batch, finished rows included; so a group's random stream depends neither on when
    its rows stop nor on which other groups share the batch. For a fixed seed, model and device the output is
    bit-identical. A group decoded in a batch with others equals that group decoded alone up to float reassociation
    (padding and larger matmuls sum in another order, ~1e-7 in fp32 logits): greedy tokens agree unless two logits
    tie that closely, and logprobs/routes match a teacher-forced forward of the same tokens. Different devices (CPU
    vs CUDA) draw different streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from longstraw.routing import RouteRecorder, find_routers
from longstraw.scoring import token_logprobs
from mint.errors import ConfigError, MintError
from mint.models.specs import moe_layout
from mint.rollout._cache import KVSlab, row_state_columns
from mint.rollout._indexer import IndexerRecorder, checked_indexers
from mint.rollout._sampling import SamplingParams, group_seed, sample_groups

# Padded prompt tokens per prefill forward: bounds the prefill's activations and temporary K/V (a 16k-token prompt
# still goes alone); on CPU, batching short prompts saves the per-forward overhead of each MoE layer's expert loop.
PREFILL_TOKENS = 16384
# KV slab slots (rows x (P_max + max_tokens - 1)) per decode batch. The slab holds every row's copy of its prompt, so
# it bounds the engine's K/V memory: 2^18 slots are 24 GiB at Qwen3-30B-A3B dims in bf16 (96 KiB per token over 48
# layers), 2 MiB on the tiny bases. A hybrid row's fixed linear-attention states count as the columns their bytes
# would fill (`row_state_columns`). A step that needs more decodes in several batches, one after the other.
MAX_BATCH_TOKENS = 2**18
# Compact the slab once finished groups hold this fraction of its rows: each compaction copies the kept rows' K/V,
# each step over a dead row costs a forward row; a quarter keeps both small.
_COMPACT_FRACTION = 0.25


@dataclass
class Completion:
    """One sampled response. Tensors are on CPU and own their storage (a pickled view would drag its whole base)."""

    tokens_R: torch.Tensor  # [R] int64; ends with the stop token when finish_reason == "stop"
    logprobs_R: torch.Tensor  # [R] float32; log softmax(logits / T) at tokens_R (T = 1 for greedy)
    routes_R_L_K: torch.Tensor | None  # [R, L, k] route_dtype; row j = routing of the forward that produced token j
    finish_reason: str  # "stop" | "length"
    indexer_R_I_K: torch.Tensor | None = None  # [R, I, K] int32 absolute key positions, -1 = none (Indexer convention)
    # An episode's tail (mint.rollout.episodes): bool [R], True on the tokens the policy sampled and the loss covers,
    # False on observation tokens (their logprobs are NaN). None: a plain response, every token sampled.
    loss_mask_R: torch.Tensor | None = None


@dataclass
class GroupRollout:
    """G completions sampled from one shared prompt prefix."""

    prompt_tokens_P: torch.Tensor  # [P] int64
    prompt_routes_P1_L_K: torch.Tensor | None  # [P-1, L, k] route_dtype; routes of prompt positions 0..P-2
    completions: list[Completion]


@dataclass
class _Decoded:
    """The explicit buffers of one batched decode, sized up front to B rows x max_tokens (STYLE 6)."""

    tokens_B_N: torch.Tensor  # [B, N] int64
    logprobs_B_N: torch.Tensor  # [B, N] float32
    routes_B_N_L_K: torch.Tensor | None  # [B, N, L, k] route_dtype
    lengths_B: torch.Tensor  # [B] int64, tokens kept per row
    stopped_B: torch.Tensor  # [B] bool, row ended on a stop/eos id


@dataclass
class _Prefilled:
    """What the prefill leaves for the decode, per distinct prompt D (the slab holds the K/V)."""

    logits_D_V: torch.Tensor | None  # [D, V] logits of each prompt's last position (they produce token 0)
    routes_D_L_K: torch.Tensor | None  # [D, L, k] routes of that last position (route row 0)
    prompt_routes: list[torch.Tensor | None] = field(default_factory=list)  # per prompt [P_d - 1, L, k] on host


class RolloutEngine:
    """Sample groups of completions from a (possibly PEFT-wrapped) causal LM, recording logprobs and routes.

    The model should be in eval mode (`mint.models.specs.load_model` does that).
    The engine adds no hooks outside a call.
    """

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: Sequence[int],
        vocab_limit: int | None = None,
        prefill_tokens: int = PREFILL_TOKENS,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        record_indexer: bool = False,
    ):
        """vocab_limit: ids >= it are never sampled nor scored (a padded head: real Qwen checkpoints have 151,936
        rows for 151,669 tokens); logits are cut to [:vocab_limit] before sampling and scoring, and the learner
        scores with the same cut (mint.models.specs.usable_vocab).
        prefill_tokens: most padded prompt tokens per prefill forward (a longer prompt is prefilled alone).
        max_batch_tokens: most KV slab slots (rows x columns) per decode batch (one group over it decodes alone); a
        hybrid model's row counts its linear-attention states as `row_state_columns` more columns.
        record_indexer: record each DSA indexer's selections per completion (Indexer convention); MintError if the
        model has no indexer."""
        for name, value in (("prefill_tokens", prefill_tokens), ("max_batch_tokens", max_batch_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"rollout: {name} must be an int >= 1, got {value!r}")
        self.model = model
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.vocab_limit = vocab_limit
        self.prefill_tokens = prefill_tokens
        self.max_batch_tokens = max_batch_tokens
        self.layout = moe_layout(model.config)
        self.device = next(model.parameters()).device
        self.row_state_columns = row_state_columns(model.config, next(model.parameters()).dtype.itemsize)
        self.indexers = checked_indexers(model) if record_indexer else []
        if self.layout is not None:
            num_routers = len(find_routers(model))
            if num_routers != self.layout.num_layers:
                raise MintError(
                    f"{type(model).__name__}: config says {self.layout.num_layers} MoE layers, found {num_routers} "
                    "routers; route recording would misalign layers"
                )

    def generate(
        self, prompts: list[Sequence[int]], group_size: int, params: SamplingParams, seed: int
    ) -> list[GroupRollout]:
        """One group of `group_size` completions per prompt, every group in one decode batch; group i draws from a
        generator seeded with `group_seed(seed, i)`."""
        generators = []
        for index in range(len(prompts)):
            generator = torch.Generator(device=self.device)
            generator.manual_seed(group_seed(seed, index))
            generators.append(generator)
        return self.generate_groups(prompts, group_size, params, generators)

    def generate_group(
        self, prompt_tokens: Sequence[int], group_size: int, params: SamplingParams, generator: torch.Generator
    ) -> GroupRollout:
        """One group of `group_size` completions of `prompt_tokens`, drawn from `generator` (a batch of one group)."""
        return self.generate_groups([prompt_tokens], group_size, params, [generator])[0]

    def generate_groups(
        self,
        prompts: list[Sequence[int]],
        group_size: int,
        params: SamplingParams,
        generators: list[torch.Generator],
    ) -> list[GroupRollout]:
        """Group i samples `prompts[i]` `group_size` times, drawing from `generators[i]`. All groups decode in one
        batch while its KV slab stays within `max_batch_tokens` slots; beyond that, groups of similar prompt length
        share a batch, one batch after the other."""
        if group_size < 1:
            raise MintError(f"rollout: group_size must be >= 1, got {group_size}")
        if len(generators) != len(prompts):
            raise MintError(f"rollout: {len(prompts)} prompts but {len(generators)} generators")
        prompts_P = [torch.as_tensor(list(p), dtype=torch.int64) for p in prompts]
        if any(p.numel() == 0 for p in prompts_P):
            raise MintError("rollout: empty prompt; a completion needs at least one prompt token to condition on")
        results: list[GroupRollout | None] = [None] * len(prompts_P)
        lengths = [p.numel() for p in prompts_P]
        extra = params.max_tokens - 1 + self.row_state_columns
        for packed in _pack(lengths, self.max_batch_tokens, rows=group_size, extra=extra):
            batch = sorted(packed)  # the caller's order inside a batch
            batch_prompts, batch_generators = [prompts_P[i] for i in batch], [generators[i] for i in batch]
            groups = self._generate_batch(batch_prompts, group_size, params, batch_generators)
            for i, group in zip(batch, groups, strict=True):
                results[i] = group
        return results

    def _generate_batch(
        self, prompts_P: list[torch.Tensor], group_size: int, params: SamplingParams, generators: list[torch.Generator]
    ) -> list[GroupRollout]:
        """One decode batch: layout, prefill, decode (see the module docstring)."""
        distinct: dict[tuple[int, ...], int] = {}
        prompt_of_group = [distinct.setdefault(tuple(p.tolist()), len(distinct)) for p in prompts_P]
        unique_D = [torch.tensor(key, dtype=torch.int64) for key in distinct]
        width = max(p.numel() for p in unique_D)
        source_B = torch.tensor(prompt_of_group, device=self.device).repeat_interleave(group_size)
        lengths_D = torch.tensor([p.numel() for p in unique_D], device=self.device)

        indexer = None
        if self.indexers:
            indexer = IndexerRecorder(self.indexers, self.model.config.index_topk, source_B, params.max_tokens)
        with torch.inference_mode(), self._recording() as recorder, indexer or nullcontext():
            cache = KVSlab(self.model.config, rows=source_B.numel(), capacity=width + params.max_tokens - 1)
            prefilled = self._prefill(unique_D, width, source_B, cache, recorder, indexer)
            first_routes_B_L_K = None if prefilled.routes_D_L_K is None else prefilled.routes_D_L_K[source_B]
            decoded = self._decode(
                cache,
                width - lengths_D[source_B],
                prefilled.logits_D_V[source_B],
                first_routes_B_L_K,
                params,
                list(generators),
                group_size,
                recorder,
                indexer,
            )
        completions = self._completions(decoded, None if indexer is None else indexer.selections().cpu())
        groups = []
        for index, (prompt_P, d) in enumerate(zip(prompts_P, prompt_of_group, strict=True)):
            routes = prefilled.prompt_routes[d]
            groups.append(
                GroupRollout(
                    prompt_tokens_P=prompt_P.clone(),
                    prompt_routes_P1_L_K=None if routes is None else routes.clone(),
                    completions=completions[index * group_size : (index + 1) * group_size],
                )
            )
        return groups

    # -- phases ---------------------------------------------------------------------------------------------------

    def _recording(self):
        return RouteRecorder(self.model) if self.layout is not None else nullcontext()

    def _forward(
        self, input_ids_B_S: torch.Tensor, cache, recorder: RouteRecorder | None, mask_B_T=None, positions_B_S=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model forward that extends `cache`. input_ids_B_S: [B, S] -> (last logits [B, V], routes [B, S, L, k]).

        mask_B_T: [B, cache length + S] (1 = attend, 0 = padding) with positions_B_S [B, S], or both None for rows
        without padding. logits_to_keep=1: only the last position is sampled from, and P x V prompt logits would be
        the biggest activation of a long prefill (P=32k, V=151k: 19 GB in fp32).
        """
        batch, seq = input_ids_B_S.shape
        extra = {} if mask_B_T is None else {"attention_mask": mask_B_T, "position_ids": positions_B_S}
        out = self.model(input_ids=input_ids_B_S, cache=cache, use_cache=True, logits_to_keep=1, **extra)
        logits_B_V = out.logits[:, -1, : self.vocab_limit]
        routes_B_S_L_K = recorder.pop_batched(batch, seq) if recorder is not None else None
        return logits_B_V, routes_B_S_L_K

    def _prefill(
        self,
        prompts_D: list[torch.Tensor],
        width: int,
        source_B: torch.Tensor,
        cache: KVSlab,
        recorder: RouteRecorder | None,
        indexer: IndexerRecorder | None = None,
    ) -> _Prefilled:
        """Run each distinct prompt [P_d] through the model once and copy its K/V into the slab rows that sample it.

        source_B: [B] the prompt of each slab row. Prompts go shortest first in left-padded batches of at most
        `prefill_tokens` padded tokens; a batch of width W lands in slab columns width-W .. width-1.
        """
        num_prompts = len(prompts_D)
        lengths = [p.numel() for p in prompts_D]
        prefilled = _Prefilled(logits_D_V=None, routes_D_L_K=None, prompt_routes=[None] * num_prompts)
        for chunk in _pack(lengths, self.prefill_tokens):
            chunk_width = max(lengths[d] for d in chunk)
            pad_S = torch.tensor([chunk_width - lengths[d] for d in chunk], device=self.device)
            ids_S_W = torch.zeros(len(chunk), chunk_width, dtype=torch.int64)
            for s, d in enumerate(chunk):
                ids_S_W[s, chunk_width - lengths[d] :] = prompts_D[d]
            mask_S_W = positions_S_W = None
            if bool((pad_S > 0).any()):
                columns_W = torch.arange(chunk_width, device=self.device)
                mask_S_W = (columns_W >= pad_S[:, None]).long()
                positions_S_W = (columns_W - pad_S[:, None]).clamp(min=0)
            prefill = DynamicCache(config=self.model.config)
            logits_S_V, routes_S_W_L_K = self._forward(
                ids_S_W.to(self.device), prefill, recorder, mask_S_W, positions_S_W
            )
            chunk_D = torch.tensor(chunk, device=self.device)
            if indexer is not None:
                indexer.prefill(chunk_D, pad_S, num_prompts)
            if prefilled.logits_D_V is None:
                prefilled.logits_D_V = logits_S_V.new_empty(num_prompts, logits_S_V.shape[-1])
            prefilled.logits_D_V[chunk_D] = logits_S_V
            # Slab rows of this batch's prompts, and which batch row each one copies.
            slot_of_prompt = torch.full((num_prompts,), -1, dtype=torch.int64, device=self.device)
            slot_of_prompt[chunk_D] = torch.arange(len(chunk), device=self.device)
            rows_R = (slot_of_prompt[source_B] >= 0).nonzero().squeeze(1)
            cache.write_prefill(prefill, rows_R, slot_of_prompt[source_B[rows_R]], width - chunk_width)
            del prefill
            if routes_S_W_L_K is not None:
                if prefilled.routes_D_L_K is None:
                    prefilled.routes_D_L_K = routes_S_W_L_K.new_empty(num_prompts, *routes_S_W_L_K.shape[2:])
                prefilled.routes_D_L_K[chunk_D] = routes_S_W_L_K[:, -1]
                for s, d in enumerate(chunk):
                    pad = chunk_width - lengths[d]
                    prefilled.prompt_routes[d] = self._to_host(routes_S_W_L_K[s, pad : chunk_width - 1])
        cache.set_length(width)
        return prefilled

    def _decode(
        self,
        cache: KVSlab,
        pad_B: torch.Tensor,
        logits_B_V: torch.Tensor,
        routes_B_L_K: torch.Tensor | None,
        params: SamplingParams,
        generators: list[torch.Generator],
        group_size: int,
        recorder: RouteRecorder | None,
        indexer: IndexerRecorder | None = None,
    ) -> _Decoded:
        """Sample up to N = max_tokens tokens for B rows (groups of `group_size`, group-major) held by `cache`.

        pad_B: [B] left-padding columns of each row's prompt in the slab; logits_B_V: [B, V] logits of the forward
        that produces token 0; routes_B_L_K: [B, L, k] that forward's routes at the last position (route row 0).
        Rows of the slab ("R", the groups still decoding) are a subset of the B rows: active_R maps them back.
        """
        num_rows, max_tokens = logits_B_V.shape[0], params.max_tokens
        device = logits_B_V.device
        width = cache.get_seq_length()
        score_temperature = params.temperature if params.temperature > 0 else 1.0
        stop_ids = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.int64)
        stop_ids = stop_ids.to(device)

        tokens_B_N = torch.zeros(num_rows, max_tokens, dtype=torch.int64, device=device)
        logprobs_B_N = torch.zeros(num_rows, max_tokens, dtype=torch.float32, device=device)
        routes_B_N_L_K = None
        if self.layout is not None:
            shape = (num_rows, max_tokens, self.layout.num_layers, self.layout.top_k)
            routes_B_N_L_K = torch.zeros(shape, dtype=self.layout.route_dtype, device=device)
        lengths_B = torch.full((num_rows,), max_tokens, dtype=torch.int64, device=device)
        done_B = torch.zeros(num_rows, dtype=torch.bool, device=device)

        active_R = torch.arange(num_rows, device=device)
        logits_R_V, routes_R_L_K, pad_R = logits_B_V, routes_B_L_K, pad_B
        mask_R_C = _padding_mask(pad_R, width + max_tokens - 1)
        for step in range(max_tokens):
            next_R = sample_groups(logits_R_V, params, generators, group_size)
            tokens_B_N[active_R, step] = next_R
            logprobs_B_N[active_R, step] = token_logprobs(logits_R_V, next_R, score_temperature)
            if routes_B_N_L_K is not None:
                routes_B_N_L_K[active_R, step] = routes_R_L_K.to(routes_B_N_L_K.dtype)  # ids < num_experts fit
            done_R = done_B[active_R]
            newly_done_R = torch.isin(next_R, stop_ids) & ~done_R
            lengths_B[active_R] = torch.where(newly_done_R, step + 1, lengths_B[active_R])
            done_R |= newly_done_R
            done_B[active_R] = done_R
            if step == max_tokens - 1:
                break
            # One host sync per step: cheaper than decoding finished groups to max_tokens.
            group_done_g = done_R.view(-1, group_size).all(dim=1)
            finished = int(group_done_g.sum())
            if finished == group_done_g.numel():
                break
            if finished and finished * group_size >= _COMPACT_FRACTION * active_R.numel():
                keep_g = (~group_done_g).nonzero().squeeze(1)
                keep_R = (keep_g[:, None] * group_size + torch.arange(group_size, device=device)).reshape(-1)
                cache.batch_select_indices(keep_R)
                generators = [generators[g] for g in keep_g.tolist()]
                active_R, next_R, pad_R = active_R[keep_R], next_R[keep_R], pad_R[keep_R]
                mask_R_C = None if mask_R_C is None else _padding_mask(pad_R, mask_R_C.shape[1])
            columns = width + step + 1
            positions_R_1 = None if mask_R_C is None else (columns - 1 - pad_R)[:, None]
            mask_R_T = None if mask_R_C is None else mask_R_C[:, :columns]
            logits_R_V, routes_R_1_L_K = self._forward(next_R[:, None], cache, recorder, mask_R_T, positions_R_1)
            routes_R_L_K = None if routes_R_1_L_K is None else routes_R_1_L_K[:, 0]
            if indexer is not None:
                indexer.decode(active_R, step + 1, pad_R)

        return _Decoded(tokens_B_N, logprobs_B_N, routes_B_N_L_K, lengths_B, done_B)

    def _to_host(self, routes_S_L_K: torch.Tensor) -> torch.Tensor:
        # .clone() after .cpu(): on CPU, .cpu() is a no-op and the slice would share (and pickle) the whole buffer.
        return routes_S_L_K.to(self.layout.route_dtype).cpu().clone()

    def _completions(self, decoded: _Decoded, indexer_B_N_I_K: torch.Tensor | None = None) -> list[Completion]:
        tokens_B_N = decoded.tokens_B_N.cpu()
        logprobs_B_N = decoded.logprobs_B_N.cpu()
        routes_B_N_L_K = None if decoded.routes_B_N_L_K is None else decoded.routes_B_N_L_K.cpu()
        lengths_B = decoded.lengths_B.tolist()
        stopped_B = decoded.stopped_B.tolist()
        completions = []
        for row, (length, stopped) in enumerate(zip(lengths_B, stopped_B, strict=True)):
            completions.append(
                Completion(
                    tokens_R=tokens_B_N[row, :length].clone(),
                    logprobs_R=logprobs_B_N[row, :length].clone(),
                    routes_R_L_K=None if routes_B_N_L_K is None else routes_B_N_L_K[row, :length].clone(),
                    finish_reason="stop" if stopped else "length",
                    indexer_R_I_K=None if indexer_B_N_I_K is None else indexer_B_N_I_K[row, :length].clone(),
                )
            )
        return completions


def _pack(lengths: list[int], budget: int, rows: int = 1, extra: int = 0) -> list[list[int]]:
    """Item indices, shortest first, cut into consecutive batches of size n whose n x rows x (longest + extra) stays
    within `budget` (an item over the budget alone forms a batch of its own)."""
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches and (len(batches[-1]) + 1) * rows * (lengths[index] + extra) <= budget:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def _padding_mask(pad_R: torch.Tensor, columns: int) -> torch.Tensor | None:
    """[R, columns] int64, 0 on each row's left padding and 1 elsewhere; None when no row is padded (the model
    then takes the plain causal path, as for a single group)."""
    if not bool((pad_R > 0).any()):
        return None
    return (torch.arange(columns, device=pad_R.device) >= pad_R[:, None]).long()


def sample_next(logits_G_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One group's next tokens, drawn as the engine draws a group's: logits_G_V [G, V] -> [G] int64.

    T = params.temperature, p = params.top_p. At T = 0 each row takes argmax(logits) (greedy; no uniform is drawn).
    Otherwise row i draws from q = softmax(logits_i / T) in fp32, truncated to the top-p nucleus: sorted by
    descending q, a token is kept while the mass strictly before it is < p (the top token always is), and the draw
    is by inverse CDF on the kept mass with one uniform per row, all G from `generator`. This is `sample_groups`
    with one group, so `mint serve` samples a request exactly as the engine samples a group alone.
    """
    return sample_groups(logits_G_V, params, [generator], logits_G_V.shape[0])
