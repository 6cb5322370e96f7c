"""The built-in rollout engine: prefill each prompt once, decode G samples from the shared prefix.

It runs on a plain Hugging Face causal LM or a PEFT-wrapped one, records what the learner needs to score the same
tokens the same way, and returns picklable `GroupRollout`s (they cross Ray).

Phases (STYLE 6): `_prefill` runs the prompt through the model once at batch 1, the KV cache is then repeated to G
rows, and `_decode` samples all G rows in one batched loop. The naive alternative, G copies of the prompt through
prefill, costs G x P prompt token-forwards instead of P; bench/rollout_prefix.py measures the difference.

Logprob convention
    `logprobs_R[j] = longstraw.scoring.token_logprobs(logits_j, tokens_R[j], T)`, i.e. log softmax(logits / T) at the
    sampled token, in fp32, where logits_j are the logits that produced token j. Top-p truncation is a sampling device
    and NOT part of the scored policy (vLLM and verl report logprobs the same way), so a token kept by top-p has the
    logprob of the untruncated tempered distribution. Greedy decoding (T = 0) records logprobs at T = 1. The learner
    calls the same `token_logprobs`, so the two sides score identically by construction.

Route convention (R3)
    Route row j of a completion is the routing computed in the forward pass that PRODUCED token j, i.e. the routing
    of the input at absolute position P-1+j (row 0 comes from the prefill's last position, row j >= 1 from decode
    step j, whose input is token j-1). The prompt routes cover prompt positions 0..P-2. So
    cat(prompt_routes_P1_L_K, routes_R_L_K) has P+R-1 rows and lines up exactly with the positions a learner feeds
    (prompt + response[:-1]) to score the response. Routes use `ExpertLayout.route_dtype` (uint8 while <= 256 experts);
    they are None for a dense model.

Stopping
    A row stops at the first eos id (from the engine) or stop id (from SamplingParams); that token IS kept as the last
    token, because the learner must train the model to emit it. A finished row keeps being fed (the batch stays
    rectangular, the KV cache stays aligned) but what it samples afterwards is discarded. The loop ends when every row
    is done or after max_tokens.

Determinism
    For a fixed seed, model and device the output is bit-identical: finished rows still draw from the generator, so
    the random stream does not depend on when rows stop. Different devices (CPU vs CUDA) draw different streams.
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


@dataclass(frozen=True)
class SamplingParams:
    """How one group is sampled. Validated at construction; stop ids are normalised to a tuple of ints."""

    temperature: float = field(default=1.0, metadata={"help": "softmax temperature; 0 means greedy (argmax)"})
    top_p: float = field(
        default=1.0,
        metadata={"help": "nucleus sampling on softmax(logits / T): keep the smallest top set with mass >= p"},
    )
    max_tokens: int = field(default=16, metadata={"help": "most tokens per completion, stop token included"})
    stop_token_ids: tuple[int, ...] = field(
        default=(), metadata={"help": "extra ids that end a completion; the model's eos ids always do"}
    )

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ConfigError(f"sampling.temperature: expected a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p: must be a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"sampling.max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        try:
            stop_ids = tuple(int(t) for t in self.stop_token_ids)
        except (TypeError, ValueError) as err:
            msg = f"sampling.stop_token_ids: expected a sequence of ints, got {self.stop_token_ids!r}"
            raise ConfigError(msg) from err
        object.__setattr__(self, "stop_token_ids", stop_ids)


@dataclass
class Completion:
    """One sampled response. Tensors are on CPU and own their storage (a pickled view would drag its whole base)."""

    tokens_R: torch.Tensor  # [R] int64; ends with the stop token when finish_reason == "stop"
    logprobs_R: torch.Tensor  # [R] float32; log softmax(logits / T) at tokens_R (T = 1 for greedy)
    routes_R_L_K: torch.Tensor | None  # [R, L, k] route_dtype; row j = routing of the forward that produced token j
    finish_reason: str  # "stop" | "length"


@dataclass
class GroupRollout:
    """G completions sampled from one shared prompt prefix."""

    prompt_tokens_P: torch.Tensor  # [P] int64
    prompt_routes_P1_L_K: torch.Tensor | None  # [P-1, L, k] route_dtype; routes of prompt positions 0..P-2
    completions: list[Completion]


@dataclass
class _Decoded:
    """The explicit buffers of one batched decode, sized up front to max_tokens (STYLE 6)."""

    tokens_G_N: torch.Tensor  # [G, N] int64
    logprobs_G_N: torch.Tensor  # [G, N] float32
    routes_G_N_L_K: torch.Tensor | None  # [G, N, L, k] route_dtype
    lengths_G: torch.Tensor  # [G] int64, tokens kept per row
    stopped_G: torch.Tensor  # [G] bool, row ended on a stop/eos id


class RolloutEngine:
    """Sample groups of completions from a (possibly PEFT-wrapped) causal LM, recording logprobs and routes.

    The model should be in eval mode (`mint.models.specs.load_model` does that).
    The engine adds no hooks outside a call.
    """

    def __init__(self, model: nn.Module, eos_token_ids: Sequence[int], vocab_limit: int | None = None):
        """vocab_limit: ids >= it are never sampled nor scored (a padded head: real Qwen checkpoints have 151,936
        rows for 151,669 tokens); logits are cut to [:vocab_limit] before sampling and scoring, and the learner
        scores with the same cut (mint.models.specs.usable_vocab)."""
        self.model = model
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.vocab_limit = vocab_limit
        self.layout = moe_layout(model.config)
        self.device = next(model.parameters()).device
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
        """One group of `group_size` completions per prompt, from one generator seeded with `seed`."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return [self.generate_group(prompt, group_size, params, generator) for prompt in prompts]

    def generate_group(
        self, prompt_tokens: Sequence[int], group_size: int, params: SamplingParams, generator: torch.Generator
    ) -> GroupRollout:
        """Prefill `prompt_tokens` once at batch 1, repeat its KV cache to G rows, decode G samples together."""
        tokens_P = torch.as_tensor(list(prompt_tokens), dtype=torch.int64)
        num_prompt = tokens_P.shape[0]
        if num_prompt == 0:
            raise MintError("rollout: empty prompt; a completion needs at least one prompt token to condition on")
        if group_size < 1:
            raise MintError(f"rollout: group_size must be >= 1, got {group_size}")
        with torch.inference_mode(), self._recording() as recorder:
            cache, logits_1_V, routes_1_P_L_K = self._prefill(tokens_P[None].to(self.device), recorder)
            # The only copy of the prompt state: G rows point at one prefill. repeat_interleave materialises G copies
            # of K/V (a DynamicCache has no shared pages), but the prompt's compute is paid once.
            cache.batch_repeat_interleave(group_size)
            logits_G_V = logits_1_V.expand(group_size, -1)
            first_routes_G_L_K = None if routes_1_P_L_K is None else routes_1_P_L_K[:, -1].expand(group_size, -1, -1)
            decoded = self._decode(cache, logits_G_V, first_routes_G_L_K, params, generator, recorder)
        prompt_routes = None if routes_1_P_L_K is None else self._to_host(routes_1_P_L_K[0, :-1])
        return GroupRollout(
            prompt_tokens_P=tokens_P.clone(),
            prompt_routes_P1_L_K=prompt_routes,
            completions=self._completions(decoded),
        )

    # -- phases ---------------------------------------------------------------------------------------------------

    def _recording(self):
        return RouteRecorder(self.model) if self.layout is not None else nullcontext()

    def _forward(
        self, input_ids_B_S: torch.Tensor, cache: DynamicCache, recorder: RouteRecorder | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model forward that extends `cache`. input_ids_B_S: [B, S] -> (last logits [B, V], routes [B, S, L, k]).

        logits_to_keep=1: only the last position is sampled from, and P x V prompt logits would be the biggest
        activation of a long prefill (P=32k, V=151k: 19 GB in fp32).
        """
        batch, seq = input_ids_B_S.shape
        out = self.model(input_ids=input_ids_B_S, cache=cache, use_cache=True, logits_to_keep=1)
        logits_B_V = out.logits[:, -1, : self.vocab_limit]
        routes_B_S_L_K = recorder.pop_batched(batch, seq) if recorder is not None else None
        return logits_B_V, routes_B_S_L_K

    def _prefill(
        self, input_ids_B_P: torch.Tensor, recorder: RouteRecorder | None
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor | None]:
        """Run the prompt(s) [B, P] once into a fresh cache -> (cache, last logits [B, V], routes [B, P, L, k])."""
        cache = DynamicCache(config=self.model.config)
        logits_B_V, routes_B_P_L_K = self._forward(input_ids_B_P, cache, recorder)
        return cache, logits_B_V, routes_B_P_L_K

    def _decode(
        self,
        cache: DynamicCache,
        logits_G_V: torch.Tensor,
        routes_G_L_K: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
        recorder: RouteRecorder | None,
    ) -> _Decoded:
        """Sample up to N = max_tokens tokens for G rows that share `cache`.

        logits_G_V: [G, V] logits of the forward that produces token 0; routes_G_L_K: [G, L, k] that forward's
        routes at the last position (route row 0, see the module docstring).
        """
        num_rows = logits_G_V.shape[0]
        max_tokens = params.max_tokens
        device = logits_G_V.device
        score_temperature = params.temperature if params.temperature > 0 else 1.0
        stop_ids = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.int64)
        stop_ids = stop_ids.to(device)

        tokens_G_N = torch.zeros(num_rows, max_tokens, dtype=torch.int64, device=device)
        logprobs_G_N = torch.zeros(num_rows, max_tokens, dtype=torch.float32, device=device)
        routes_G_N_L_K = None
        if self.layout is not None:
            shape = (num_rows, max_tokens, self.layout.num_layers, self.layout.top_k)
            routes_G_N_L_K = torch.zeros(shape, dtype=self.layout.route_dtype, device=device)
        lengths_G = torch.full((num_rows,), max_tokens, dtype=torch.int64, device=device)
        done_G = torch.zeros(num_rows, dtype=torch.bool, device=device)

        for step in range(max_tokens):
            next_G = _sample(logits_G_V, params, generator)
            tokens_G_N[:, step] = next_G
            logprobs_G_N[:, step] = token_logprobs(logits_G_V, next_G, score_temperature)
            if routes_G_N_L_K is not None:
                routes_G_N_L_K[:, step] = routes_G_L_K  # int64 ids -> route_dtype; ids < num_experts fit
            newly_done_G = torch.isin(next_G, stop_ids) & ~done_G
            lengths_G = torch.where(newly_done_G, step + 1, lengths_G)
            done_G |= newly_done_G
            # .all() syncs the host once per step; one small sync is cheaper than decoding dead rows to max_tokens.
            if step == max_tokens - 1 or bool(done_G.all()):
                break
            logits_G_V, routes_G_1_L_K = self._forward(next_G[:, None], cache, recorder)
            routes_G_L_K = None if routes_G_1_L_K is None else routes_G_1_L_K[:, 0]

        stopped_G = done_G
        return _Decoded(tokens_G_N, logprobs_G_N, routes_G_N_L_K, lengths_G, stopped_G)

    def _to_host(self, routes_S_L_K: torch.Tensor) -> torch.Tensor:
        # .clone() after .cpu(): on CPU, .cpu() is a no-op and the slice would share (and pickle) the whole buffer.
        return routes_S_L_K.to(self.layout.route_dtype).cpu().clone()

    def _completions(self, decoded: _Decoded) -> list[Completion]:
        tokens_G_N = decoded.tokens_G_N.cpu()
        logprobs_G_N = decoded.logprobs_G_N.cpu()
        routes_G_N_L_K = None if decoded.routes_G_N_L_K is None else decoded.routes_G_N_L_K.cpu()
        lengths_G = decoded.lengths_G.tolist()
        stopped_G = decoded.stopped_G.tolist()
        completions = []
        for row, (length, stopped) in enumerate(zip(lengths_G, stopped_G, strict=True)):
            completions.append(
                Completion(
                    tokens_R=tokens_G_N[row, :length].clone(),
                    logprobs_R=logprobs_G_N[row, :length].clone(),
                    routes_R_L_K=None if routes_G_N_L_K is None else routes_G_N_L_K[row, :length].clone(),
                    finish_reason="stop" if stopped else "length",
                )
            )
        return completions


def _sample(logits_G_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Next token per row: argmax for T = 0, else a draw from softmax(logits / T) truncated to the top-p nucleus.

    logits_G_V: [G, V] -> [G] int64 on the logits' device. The draw happens on the generator's device so that a
    CPU generator drives a CUDA model deterministically too (at the cost of one [G, V] copy per step).
    """
    if params.temperature == 0:
        return logits_G_V.argmax(dim=-1)
    probs_G_V = torch.softmax(logits_G_V.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_G_V, order_G_V = probs_G_V.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the top token is therefore always
        # kept, so top_p -> 0 degenerates to greedy.
        mass_before_G_V = sorted_G_V.cumsum(dim=-1) - sorted_G_V
        sorted_G_V = sorted_G_V.masked_fill(mass_before_G_V >= params.top_p, 0.0)
        probs_G_V = torch.zeros_like(probs_G_V).scatter_(-1, order_G_V, sorted_G_V)
    draws_G = torch.multinomial(probs_G_V.to(generator.device), 1, generator=generator).squeeze(-1)
    return draws_G.to(logits_G_V.device)
