"""The per-GPU memory plan of a LongStraw learner rank: every term from real dims or measured per-layer figures.

    weights        the frozen base in its dtype: parameters counted from the real config (they reproduce the published
                   totals), experts divided over the expert-parallel group; with an FP8 base (Job.quantization)
                   attention, experts and dense MLPs at 1 byte + a fp32 scale per 128 x 128 block, the rest in the
                   dtype, plus one matrix dequantized at a time (the largest) as a transient; with an INT4 base
                   (Kimi-K2.5's scheme) the routed experts at half a byte + a bf16 scale per 32 weights
    lora + optim   LoRA parameters from the dims and the rank; bf16 weights and gradients, fp32 master copy and two
                   Adam moments, the fp32 part sharded over the data-parallel ranks (ZeRO-1)
    prefix K/V     P x layers x 2 x kv_heads x head_dim in the dtype, over the context-parallel group
    prefix dK/dV   exact mode: the same in fp32
    prompt chunk   measured bytes saved per token per layer by one checkpointed prompt-backward chunk x C x layers
    replay         measured bytes saved per token per layer by a checkpointed replay x R x layers, plus one layer
                   recomputed in full (the uncheckpointed per-token-layer figure x R) and the scoring transient
    rollout KV     on the rollout GPUs, not the learner's: G sequences of P + R tokens of K/V per engine

Hybrid shapes (Gated DeltaNet + gated full attention, `RealShape.hybrid`) count instead:
    prefix K/V           P x full layers only x 2 x kv_heads x head_dim in the dtype, over the CP group (grows with P)
    boundary state       one sequence's recurrent state over the linear layers: S [H_v, d_k, d_v] fp32 + the conv
                         window, K - 1 rows of conv_dim in the dtype (flat in P)
    prefix dK/dV         exact mode: the full layers' K/V in fp32
    state checkpoints    exact mode: one boundary state at every capture-chunk start after the first,
                         ceil((P - 1) / C) - 1 of them (grows with P / C)
    state gradients      exact mode: dS and dWindow of one boundary state in fp32, and the one carried back through
                         the prompt backward: 2 fp32 boundary states
    chunk / replay       the measured per-token figures of each layer kind x its layer count
    working buffers      the measured tensor peak of one layer's forward + backward over a chunk, scaled to C
Nothing in the boundary terms is split over a context-parallel group (the recurrence runs the prompt in order).

MLA shapes (`RealShape.mla`: DeepSeek-V3.2, GLM-4.7-Flash, GLM-5, Kimi-K2.5) count instead:
    prefix latent pages  P x layers x (kv_lora_rank + qk_rope_head_dim) in the dtype, over the CP group: the normed
                         latent and the roped key LongStraw keeps instead of expanded K/V (heads x (nope + rope + v))
    indexer pages        DSA only: P x indexer layers x index_head_dim in the dtype, over the CP group; no gradient
    prefix dLatent       exact mode: the latent pages' shape in fp32 (dC, dKr)
    indexer replay       DSA, off by default (Job.indexer_replay): index_topk int32 key indices per response token
                         and indexer layer, G x R of them; shown as 0 when off, with what it would take
    chunk / replay       the measured per-token figures of one MLA MoE layer x the layer count (the dense first layers
                         are counted as MoE ones: checkpointed, both keep only the layer input)
    working buffers      the measured tensor peak of one MLA MoE layer's forward + backward over a chunk, scaled to C
The measured figures come from bench/real_shapes.py (mint/models/measured/<shape>.json). Nothing is inferred from
the tiny model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mint.errors import ConfigError
from mint.models import families
from mint.models.shapes import RealShape

MEASURED = Path(__file__).parent / "measured"
GiB = 2**30
# Allocator fragmentation, the CUDA context and NCCL buffers: plan for 90% of the card.
USABLE = 0.9
# Two fp32 [rows, V] blocks of the fused log-prob's CPU path / about that on GPU.
SCORE_BYTES = 2 * (1 << 21) * 4


@dataclass(frozen=True)
class Job:
    prompt_len: int
    group: int
    response_len: int
    lora_rank: int = 32
    chunk: int = 1024
    mode: str = "exact"
    data_parallel: int = 1  # learner ranks sharing the ZeRO-1 optimizer state
    expert_parallel: int = 1
    context_parallel: int = 1
    dtype_bytes: int = 2
    indexer_replay: bool = False  # DSA: record the rollout's top-k key indices per response token (off by default)
    quantization: str = "none"  # "fp8": linears and experts FP8 with block scales; "int4": experts packed INT4


@dataclass
class Plan:
    shape: RealShape
    job: Job
    gpu_bytes: int
    terms: dict[str, float] = field(default_factory=dict)
    rollout_kv: float = 0.0  # on the rollout engines' GPUs, not the learner's: shown, not added

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total <= USABLE * self.gpu_bytes

    def table(self) -> str:
        rows = [f"| {name} | {value / GiB:,.2f} |" for name, value in self.terms.items()]
        verdict = "fits" if self.fits else "does NOT fit"
        head = (
            f"{self.shape.name}: P={self.job.prompt_len}, G={self.job.group}, R={self.job.response_len}, "
            f"LoRA r={self.job.lora_rank}, {self.job.mode}, DP={self.job.data_parallel}, "
            f"EP={self.job.expert_parallel}, CP={self.job.context_parallel}"
        )
        return "\n".join(
            [
                head,
                "",
                "| term (per learner GPU) | GiB |",
                "|---|---|",
                *rows,
                f"| **total** | **{self.total / GiB:,.2f}** |",
                "",
                f"{verdict} in {self.gpu_bytes / GiB:.0f} GiB "
                f"({USABLE:.0%} usable: {USABLE * self.gpu_bytes / GiB:.1f} GiB)",
                f"rollout engines hold {self.rollout_kv / GiB:,.2f} GiB of K/V per group of G sequences (their GPUs)",
                *self._hybrid_lines(),
                *self._mla_lines(),
            ]
        )

    def _mla_lines(self) -> list[str]:
        s, j = self.shape, self.job
        if not s.mla:
            return []
        b = j.dtype_bytes
        lines = [
            f"MLA: latent pages {s.latent_bytes_per_token(b) / 1024:.1f} KiB per prompt token ({s.layers} layers x "
            f"{s.kv_lora_rank + s.qk_rope_head_dim}); expanded K/V would be "
            f"{s.expanded_kv_bytes_per_token(b) / 1024:.1f} KiB "
            f"({s.expanded_kv_bytes_per_token(b) / s.latent_bytes_per_token(b):.1f}x)"
        ]
        if s.dsa:
            record = j.group * j.response_len * s.indexer_replay_bytes_per_token()
            lines.append(
                f"DSA: indexer pages {s.indexer_bytes_per_token(b) / 1024:.1f} KiB per prompt token; indexer replay "
                f"{'on' if j.indexer_replay else 'off'}: {record / GiB:,.2f} GiB per group ({j.group} x "
                f"{j.response_len} tokens x {s.indexer_layers} layers x {s.index_topk} int32)"
            )
        return lines

    def _hybrid_lines(self) -> list[str]:
        s, b = self.shape, self.job.dtype_bytes
        if not s.hybrid:
            return []
        return [
            f"hybrid: K/V pages of the {s.full_layers} full layers only, {s.kv_bytes_per_token(b) / 1024:.1f} KiB per "
            f"prompt token; boundary state of the {s.linear_layers} linear layers "
            f"{s.boundary_state_bytes(b) / 2**20:.1f} MiB per sequence, whatever P"
        ]


def measured(shape_key: str) -> dict:
    path = MEASURED / f"{shape_key}.json"
    if not path.exists():
        raise ConfigError(
            f"no measured per-layer figures for {shape_key}: run bench/real_shapes.py --shape {shape_key} --save"
        )
    return json.loads(path.read_text())


def _q_out(s: RealShape) -> int:
    """q_proj's output width: the queries, and as many sigmoid output-gate logits with an output gate."""
    return s.heads * s.head_dim * (2 if s.attn_output_gate else 1)


def linear_attention_params(s: RealShape) -> int:
    """One Gated DeltaNet layer: q/k/v (conv_dim) and z (H_v d_v) in-projections, a and b (H_v each), the depthwise
    conv (conv_dim x K), the out-projection, dt_bias and A_log (H_v each) and the gated norm (d_v)."""
    value = s.linear_value_heads * s.linear_value_head_dim
    proj = s.hidden * (s.conv_dim + value + 2 * s.linear_value_heads) + value * s.hidden
    return proj + s.conv_dim * s.linear_conv_kernel + 2 * s.linear_value_heads + s.linear_value_head_dim


def mla_attention_params(s: RealShape) -> int:
    """One MLA layer: q_a_proj, its norm and q_b_proj (or one q_proj), kv_a_proj_with_mqa (latent + rope key) and the
    latent's norm, kv_b_proj (latent -> heads x (nope + v)), o_proj. The DSA indexer is `indexer_params`."""
    q_head = s.qk_nope_head_dim + s.qk_rope_head_dim
    if s.q_lora_rank:
        q = s.hidden * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * s.heads * q_head
    else:
        q = s.hidden * s.heads * q_head
    kv = s.hidden * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank
    kv += s.kv_lora_rank * s.heads * (s.qk_nope_head_dim + s.v_head_dim)
    return q + kv + s.heads * s.v_head_dim * s.hidden


def indexer_params(s: RealShape) -> int:
    """One DSA lightning indexer: wq_b (query latent -> index_heads x index_head_dim), wk (hidden -> one key), the
    key's LayerNorm (weight and bias) and weights_proj (hidden -> one weight per indexer head)."""
    index = s.index_heads * s.index_head_dim
    return s.q_lora_rank * index + s.hidden * s.index_head_dim + 2 * s.index_head_dim + s.hidden * s.index_heads


def mla_lora_modules(s: RealShape) -> dict[str, tuple[int, int]]:
    """The MLA recipe's LoRA targets, name -> (in, out): the query projections, the latent's down- and
    up-projections and o_proj (the indexer runs without a gradient and gets none)."""
    q_head = s.qk_nope_head_dim + s.qk_rope_head_dim
    if s.q_lora_rank:
        q = {"q_a_proj": (s.hidden, s.q_lora_rank), "q_b_proj": (s.q_lora_rank, s.heads * q_head)}
    else:
        q = {"q_proj": (s.hidden, s.heads * q_head)}
    return {
        **q,
        "kv_a_proj_with_mqa": (s.hidden, s.kv_lora_rank + s.qk_rope_head_dim),
        "kv_b_proj": (s.kv_lora_rank, s.heads * (s.qk_nope_head_dim + s.v_head_dim)),
        "o_proj": (s.heads * s.v_head_dim, s.hidden),
    }


def param_counts(s: RealShape) -> dict[str, int]:
    """Parameter counts by part, from the dims (cross-checked against the published totals in tests)."""
    if s.mla:
        attn = mla_attention_params(s)
    else:
        attn = s.hidden * _q_out(s) + s.hidden * s.kv_heads * s.head_dim * 2 + s.heads * s.head_dim * s.hidden
    indexers = s.indexer_layers * indexer_params(s) if s.dsa else 0
    experts = s.experts * 3 * s.hidden * s.moe_intermediate
    shared = 3 * s.hidden * s.shared_intermediate + (s.hidden if s.shared_expert_gate else 0)
    router = s.experts * s.hidden
    dense = 3 * s.hidden * s.intermediate
    return {
        "embed_head": 2 * s.vocab * s.hidden,
        "attention": s.full_layers * attn + s.linear_layers * linear_attention_params(s) + indexers,
        "experts": s.moe_layers * experts,
        "shared_dense": s.moe_layers * shared + s.dense_layers * dense,
        "router": s.moe_layers * router,
    }


# FP8 base (mint.models.quant): a byte per weight plus one fp32 scale per 128 x 128 block, for the parts FP8
# releases quantize (attention, experts, shared and dense MLPs); the embeddings, head and routers stay in the dtype.
FP8_BYTES_PER_WEIGHT = 1 + 4 / (128 * 128)
# INT4 base (mint.models.quant_int4) in Kimi-K2.5's scheme: the routed experts only, 4-bit ints packed eight to an
# int32 word plus one bf16 scale per group of 32 inputs; everything else stays in the dtype.
INT4_BYTES_PER_WEIGHT = 0.5 + 2 / 32
QUANTIZED = {
    "fp8": (FP8_BYTES_PER_WEIGHT, ("attention", "experts", "shared_dense")),
    "int4": (INT4_BYTES_PER_WEIGHT, ("experts",)),
}
QUANTIZED_LABELS = {"fp8": "FP8 + block scales", "int4": "INT4 experts + group scales"}


def weight_bytes(s: RealShape, job: Job) -> float:
    """The frozen base on one learner rank: the experts divided over the EP group, the rest whole."""
    per_quantized, parts = QUANTIZED.get(job.quantization, (0.0, ()))
    total = 0.0
    for part, n in param_counts(s).items():
        per_weight = per_quantized if part in parts else job.dtype_bytes
        total += n * per_weight / (job.expert_parallel if part == "experts" else 1)
    return total


def largest_weight(s: RealShape, quantization: str = "fp8") -> int:
    """Weights in the largest single quantized matrix: what one dequantizing matmul forms at a time. FP8: the dense
    MLP's gate or up, one expert's fused gate_up, or an attention projection; INT4: one expert's fused gate_up."""
    if quantization == "int4":
        return 2 * s.hidden * s.moe_intermediate
    if s.mla:
        attention = [i * o for i, o in mla_lora_modules(s).values()]
    else:
        attention = [s.hidden * _q_out(s), s.heads * s.head_dim * s.hidden]
    mlp = [s.hidden * s.intermediate if s.dense_layers else 0, 2 * s.hidden * s.moe_intermediate]
    return max(attention + mlp + [s.hidden * s.shared_intermediate])


def lora_param_parts(s: RealShape, rank: int) -> tuple[int, int]:
    """(attention, experts) LoRA parameters: q, k, v, o and the fused experts' gate_up and down, as mint's default
    [lora] section puts them. A hybrid's q/k/v/o exist in its full-attention layers only; an MLA shape's targets are
    `mla_lora_modules` (what its recipes set)."""
    experts = s.experts * rank * ((s.hidden + 2 * s.moe_intermediate) + (s.moe_intermediate + s.hidden))
    if s.mla:
        return s.layers * sum(rank * (i + o) for i, o in mla_lora_modules(s).values()), s.moe_layers * experts
    q = rank * (s.hidden + _q_out(s))
    kv = 2 * rank * (s.hidden + s.kv_heads * s.head_dim)
    o = rank * (s.heads * s.head_dim + s.hidden)
    return s.full_layers * (q + kv + o), s.moe_layers * experts


def lora_params(s: RealShape, rank: int) -> int:
    return sum(lora_param_parts(s, rank))


def state_checkpoints(prompt_len: int, chunk: int) -> int:
    """Exact mode's boundary-state checkpoints: one at every capture-chunk start after the first."""
    return max(0, -(-(prompt_len - 1) // chunk) - 1)


def hybrid_terms(s: RealShape, m: dict, job: Job) -> dict[str, float]:
    """The prompt-state, graph and buffer terms of a hybrid shape (module docstring); weights and LoRA are common."""
    b, P, R = job.dtype_bytes, job.prompt_len, job.response_len
    boundary = s.boundary_state_bytes(b)
    terms = {
        f"prefix K/V ({s.full_layers} full layers)": P * s.kv_bytes_per_token(b) / job.context_parallel,
        f"boundary state ({s.linear_layers} linear layers)": boundary,
    }
    chunk = min(job.chunk, P)
    if job.mode == "exact":
        n_ckpt = state_checkpoints(P, job.chunk)
        terms[f"prefix dK/dV (fp32, {s.full_layers} full layers)"] = P * s.kv_bytes_per_token(4) / job.context_parallel
        terms[f"state checkpoints ({n_ckpt} x boundary state, C={job.chunk})"] = n_ckpt * boundary
        terms["boundary-state gradients (2 x fp32)"] = 2 * s.boundary_state_bytes(4)
        per_chunk_token = s.linear_layers * m["linear_ckpt_chunk_saved_bytes_per_token"]
        per_chunk_token += (s.full_layers - 1) * m["full_ckpt_chunk_saved_bytes_per_token"]  # the last stops at K/V
        terms["prompt-backward chunk graph"] = per_chunk_token * chunk
    replay = s.linear_layers * m["linear_ckpt_replay_saved_bytes_per_token"]
    replay += s.full_layers * m["full_ckpt_replay_saved_bytes_per_token"]
    replay += max(m["linear_replay_saved_bytes_per_token"], m["full_replay_saved_bytes_per_token"])  # one recomputed
    terms["replay graph (checkpointed) + scoring"] = replay * R + SCORE_BYTES
    peak = max(m["linear_chunk_layer_peak_bytes"], m["full_chunk_layer_peak_bytes"])
    terms["working buffers (one layer's fwd+bwd over a chunk, measured)"] = peak * chunk / m["chunk"]
    return terms


def mla_terms(s: RealShape, m: dict, job: Job) -> dict[str, float]:
    """The prompt-state, graph and buffer terms of an MLA shape (module docstring); weights and LoRA are common."""
    b, P, R, cp = job.dtype_bytes, job.prompt_len, job.response_len, job.context_parallel
    width = s.kv_lora_rank + s.qk_rope_head_dim
    terms = {f"prefix latent pages ({s.layers} layers x {width})": P * s.latent_bytes_per_token(b) / cp}
    if s.dsa:
        terms[f"indexer pages ({s.indexer_layers} layers x {s.index_head_dim}, no gradient)"] = (
            P * s.indexer_bytes_per_token(b) / cp
        )
    chunk = min(job.chunk, P)
    if job.mode == "exact":
        terms[f"prefix dLatent (fp32, {s.layers} layers)"] = P * s.latent_bytes_per_token(4) / cp
        # A prompt chunk runs every layer but the last in full (the last stops at its latent page).
        terms["prompt-backward chunk graph"] = m["mla_ckpt_chunk_saved_bytes_per_token"] * chunk * (s.layers - 1)
    replay = s.layers * m["mla_ckpt_replay_saved_bytes_per_token"] + m["mla_replay_saved_bytes_per_token"]
    terms["replay graph (checkpointed) + scoring"] = replay * R + SCORE_BYTES
    if s.dsa:
        record = job.group * R * s.indexer_replay_bytes_per_token()
        terms[f"indexer replay record ({'on' if job.indexer_replay else 'off'})"] = record if job.indexer_replay else 0
    terms["working buffers (one layer's fwd+bwd over a chunk, measured)"] = (
        m["mla_chunk_layer_peak_bytes"] * chunk / m["chunk"]
    )
    return terms


def make_plan(s: RealShape, shape_key: str, job: Job, gpu_bytes: int) -> Plan:
    if job.mode not in ("exact", "detached"):
        raise ConfigError(f"plan: mode {job.mode!r} is not exact or detached")
    figures = measured(shape_key)
    m = figures["per_layer"]
    b = job.dtype_bytes
    attn_lora, expert_lora = lora_param_parts(s, job.lora_rank)
    n_lora = attn_lora + expert_lora / job.expert_parallel  # a rank holds its experts' LoRA only
    optim = n_lora * (2 * b + 12 / job.data_parallel)
    terms = {
        "frozen base weights" + (f" ({QUANTIZED_LABELS[job.quantization]})" if job.quantization in QUANTIZED else ""): (
            weight_bytes(s, job)
        ),
        "LoRA + grads + AdamW (ZeRO-1)": optim,
    }
    if job.quantization in QUANTIZED:  # forward and backward each dequantize one matrix at a time, freed after it
        name = job.quantization.upper()
        terms[f"{name} dequantize transient (largest matrix in the dtype)"] = largest_weight(s, job.quantization) * b
    if s.mla:
        terms.update(mla_terms(s, {**m, "chunk": figures["chunk"]}, job))
        per_token = s.latent_bytes_per_token(b) + s.indexer_bytes_per_token(b)
        return Plan(s, job, gpu_bytes, terms, job.group * (job.prompt_len + job.response_len) * per_token)
    if s.hybrid:
        terms.update(hybrid_terms(s, {**m, "chunk": figures["chunk"]}, job))
        per_sequence = (job.prompt_len + job.response_len) * s.kv_bytes_per_token(b) + s.boundary_state_bytes(b)
        return Plan(s, job, gpu_bytes, terms, job.group * per_sequence)
    kv_token = s.layers * 2 * s.kv_heads * s.head_dim
    terms["prefix K/V"] = job.prompt_len * kv_token * b / job.context_parallel
    if job.mode == "exact":
        terms["prefix dK/dV (fp32)"] = job.prompt_len * kv_token * 4 / job.context_parallel
        chunk = min(job.chunk, job.prompt_len)
        per_token = m["factored_ckpt_chunk_saved_bytes_per_token_layer"]
        terms["prompt-backward chunk graph"] = per_token * chunk * (s.layers - 1)
    replay = m["factored_ckpt_replay_saved_bytes_per_token_layer"] * job.response_len * s.layers
    replay += m["factored_replay_saved_bytes_per_token_layer"] * job.response_len  # one layer recomputed whole
    terms["replay graph (checkpointed) + scoring"] = replay + SCORE_BYTES
    # Measured: the update's RSS peak above everything it keeps (a chunk's routed-expert buffers, allocator slack).
    terms["working buffers (measured peak above kept terms)"] = m.get("factored_ckpt_transient_bytes", 0)
    rollout_kv = job.group * (job.prompt_len + job.response_len) * kv_token * b
    return Plan(s, job, gpu_bytes, terms, rollout_kv)


def largest_prompt(s: RealShape, shape_key: str, job: Job, gpu_bytes: int, ceiling: int = 1 << 24) -> int:
    """The largest P (a multiple of 1024) at the job's G and R whose plan fits; 0 when none does."""
    lo, hi = 0, ceiling // 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        job_mid = Job(**{**job.__dict__, "prompt_len": mid * 1024})
        if make_plan(s, shape_key, job_mid, gpu_bytes).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * 1024


def parse_bytes(text: str) -> int:
    """'96GB', '96GiB', '141G' -> bytes (GB and G read as GiB, as GPU spec sheets mean them)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"G": GiB, "T": 1024 * GiB, "M": 2**20}.get(t[-1:])
    try:
        return int(float(t[:-1]) * scale) if scale else int(float(t))
    except ValueError:
        raise ConfigError(f"--gpu-memory: {text!r} is not a size like 96GB") from None


def hub_shape(model_path: str) -> str | None:
    """The real shape (mint.models.shapes) of a hub id a recipe may name, from the family registry's entries."""
    return families.hub_shapes().get(model_path)
