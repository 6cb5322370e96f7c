"""One GRPO update over a prompt and its G responses, inside a memory bound.

Phases, each its own function:
  capture   prefill prompt positions 0..P-2 in chunks, no autograd, no logits: the prefix state (per layer, by the
            adapter's kind: K/V pages of attention layers, the recurrent boundary of linear-attention layers).
  reference with the adapter disabled, capture the prompt again and score every response, no graph (need_ref).
  replay    per micro-batch of responses, with autograd: run each [t_{P-1}, r_0 .. r_{R_i-2}] at positions
            P-1 .. P+R_i-2 against the prefix state (B rows padded to the longest, longstraw.replay), score
            r_0 .. r_{R_i-1}, call the caller's objective per response, one backward for the micro-batch, free the
            graph. spec.replay_budget_bytes sizes the micro-batches; 0 replays one response at a time.
  prompt    exact mode only: back-propagate the dK/dV accumulated over the G replays through the prompt, chunk by
            chunk from last to first.

The last prompt position is not captured: each replay recomputes it (one token), so response token 0's logits come
from a live forward and its gradient reaches the LoRA parameters at that position in every mode. What each mode
treats as constant:
  detached  K/V of all P prompt positions (0..P-2 from the capture, P-1's own K/V detached in the replay).
  exact     nothing: the gradient is full-sequence backprop of sum_i objective_i.
  resident  as detached, but the prefix state was captured `age` updates ago, with the adapter as it was then.

The optimizer is never stepped here: LoRA gradients accumulate in `.grad` and the caller steps after the update.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from longstraw.adapters import Adapter, PrefixState, adapter_for
from longstraw.errors import LongStrawError
from longstraw.indexer_replay import IndexerReplay
from longstraw.memory import GraphMeter, PeakMeter, module_storages
from longstraw.replay import native_routes, plan_micro_batches, positions_hook, score_response, score_responses
from longstraw.routing import RouteReplay, SequenceRoutes

__all__ = ["PrefixCapture", "UpdateMetrics", "UpdateSpec", "capture_prefix", "grpo_update", "score_response"]

MODES = ("detached", "exact", "resident")

# objective(i, logp_R, ref_logp_R) -> (loss of response i, float stats to sum over the group)
Objective = Callable[[int, torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, dict[str, float]]"]
# backward(scalar, last, carries_scale): run backward on a scalar; `last` is true for the update's final backward. A
# training framework that owns backward (DeepSpeed's engine.backward and its accumulation boundary) plugs in here.
# carries_scale is true for exact mode's prompt surrogates <out, g>: g was accumulated from earlier backward calls,
# so it already carries any factor the framework multiplies every loss by (fp16 loss scaling), and the framework must
# not apply that factor a second time.
Backward = Callable[[torch.Tensor, bool, bool], None]


def _plain_backward(loss: torch.Tensor, last: bool, carries_scale: bool = False) -> None:
    loss.backward()


@dataclass(frozen=True)
class UpdateSpec:
    mode: str = field(default="detached", metadata={"help": "detached | exact | resident (see module docstring)."})
    chunk_size: int = field(default=1024, metadata={"help": "C: prompt positions per capture / prompt-backward chunk."})
    temperature: float = field(default=1.0, metadata={"help": "Scoring temperature: logp = log softmax(logits / T)."})
    need_ref: bool = field(default=False, metadata={"help": "Score the reference (adapter disabled) for the loss."})
    measure_graph: bool = field(
        default=False, metadata={"help": "Meter bytes saved for backward per replay (graph_bytes_max)."}
    )
    measure: bool = field(
        default=True,
        metadata={
            "help": "Time the phases and meter the update's peak: 8 to 10 CUDA synchronizes (two per timed phase, "
            "two for the meter), and the meter resets the device's process-wide peak. False inside a caller that "
            "meters its own step (the learner): then no synchronize, no reset, and the timings and peak are None."
        },
    )
    max_prefix_age: int = field(
        default=0, metadata={"help": "resident: recapture once a prefix has served this many updates (0 = never)."}
    )
    checkpoint_min_tokens: int = field(
        default=256,
        metadata={
            "help": "Checkpoint each layer in replays and prompt-backward chunks of at least this many tokens "
            "(0: never): the graph keeps layer inputs, backward recomputes the layer."
        },
    )
    vocab_limit: int | None = field(
        default=None, metadata={"help": "Score only token ids below it (a padded LM head); None: every row."}
    )
    replay_budget_bytes: int = field(
        default=0,
        metadata={
            "help": "Bytes a replay micro-batch may save for backward, by the adapter's estimate: responses are "
            "replayed together while their micro-batch fits (longstraw.replay); responses of checkpoint_min_tokens "
            "or more replay alone. 0, or less than one response needs: one response at a time."
        },
    )
    kernels: str = field(
        default="auto",
        metadata={"help": "auto: Triton on CUDA, the kernels' torch reference on CPU; on: Triton; off: reference."},
    )

    def __post_init__(self):
        if self.mode not in MODES:
            raise LongStrawError(f"UpdateSpec.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.chunk_size < 1:
            raise LongStrawError(f"UpdateSpec.chunk_size: must be >= 1, got {self.chunk_size}")
        if self.temperature <= 0:
            raise LongStrawError(f"UpdateSpec.temperature: must be > 0, got {self.temperature}")
        if self.kernels not in ("auto", "on", "off"):
            raise LongStrawError(f"UpdateSpec.kernels: {self.kernels!r} is not one of auto, on, off")
        if self.checkpoint_min_tokens < 0:
            raise LongStrawError(f"UpdateSpec.checkpoint_min_tokens: must be >= 0, got {self.checkpoint_min_tokens}")
        if self.max_prefix_age < 0:
            raise LongStrawError(f"UpdateSpec.max_prefix_age: must be >= 0, got {self.max_prefix_age}")
        if self.replay_budget_bytes < 0:
            raise LongStrawError(f"UpdateSpec.replay_budget_bytes: must be >= 0, got {self.replay_budget_bytes}")


@dataclass(frozen=True)
class UpdateMetrics:
    """What one update did. Plain data: pickles across a Ray boundary."""

    mode: str
    loss: float  # sum over responses of the objective's loss
    stats: dict[str, float]  # sums over responses of the objective's stats
    tokens: int  # response tokens scored (sum of R_i)
    responses: int
    peak_memory_bytes: int | None  # measured peak above the level at entry (RSS on CPU, allocator on CUDA)
    prefix_bytes: int  # M_prefix: the captured state
    dkv_bytes: int  # exact mode's gradient buffer (fp32), else 0
    graph_bytes_max: int  # M_graph: max over replay micro-batches of bytes saved for backward (measure_graph)
    prompt_graph_bytes_max: int  # exact: max over prompt chunks of bytes saved for backward (measure_graph)
    prefix_age: int  # updates since the prefix was captured (0 unless resident)
    # Seconds per phase. These and peak_memory_bytes are None when the spec's `measure` is off.
    capture_s: float | None
    ref_s: float | None
    replay_s: float | None
    prompt_backward_s: float | None
    micro_batches: int = 0  # replay forwards (G when serial)
    # DSA indexer replay (records given): response query x indexer layer pairs replayed, and those where the
    # learner's own selection differed from the record.
    indexer_replayed: int = 0
    indexer_mismatched: int = 0
    # R3 (routes given): per response, the expert ids the routers picked themselves in its replay, [R_i, L, k] on
    # the model's device (the caller measures how far they are from the recorded routes); None without routes.
    native_routes: tuple[torch.Tensor, ...] | None = field(default=None, compare=False, repr=False)


@dataclass
class PrefixCapture:
    """A captured prompt that a caller may keep and pass back (resident mode). `age` counts the updates it has
    served before the current one; with one optimizer step per update (as mint runs), that is steps of staleness."""

    tokens_P: torch.Tensor
    state: PrefixState
    age: int = 0


def capture_prefix(
    model: nn.Module, tokens_P: torch.Tensor, chunk_size: int = 1024, adapter: Adapter | None = None
) -> PrefixCapture:
    """Capture positions 0..P-2 of `tokens_P` ([P] int64) under the model's current adapter, without autograd."""
    adapter = adapter or adapter_for(model)
    _check_tokens("tokens_P", tokens_P)
    return PrefixCapture(tokens_P.clone(), adapter.capture(tokens_P[:-1], chunk_size))


def grpo_update(
    model: nn.Module,
    tokens_P: torch.Tensor,
    responses: list[torch.Tensor],
    objective: Objective,
    spec: UpdateSpec,
    adapter: Adapter | None = None,
    capture: PrefixCapture | None = None,
    backward: Backward | None = None,
    routes: SequenceRoutes | None = None,
    indexer: list[torch.Tensor | None] | None = None,
) -> UpdateMetrics:
    """Accumulate the LoRA gradient of sum_i objective(i, logp_i, ref_logp_i) into `.grad`; return metrics.

    tokens_P: [P] int64; responses: G tensors [R_i] int64 (R_i >= 1), on the model's device.
    logp_i: [R_i] fp32, log softmax(logits / T) of r_i given prompt and r_i[:j], with autograd.
    ref_logp_i: the same under the adapter disabled, no graph; None unless spec.need_ref.
    capture: resident mode's kept prefix (see `capture_prefix`); it must match tokens_P.
    backward: how to run each backward (default `loss.backward()`); every backward here is on a scalar.
    routes: R3, the recorded expert ids per position; every forward of the update (capture, reference, replays,
        prompt backward) replays them where they are usable (longstraw.routing.SequenceRoutes), and the routers' own
        picks in each response's replay come back in UpdateMetrics.native_routes.
    indexer: DSA indexer replay, per response the rollout's selections [R_i, indexer layers, index_topk] (or None):
        its forwards attend to them past index_topk (longstraw.indexer_replay); UpdateMetrics counts mismatches.
    Nothing else the caller passes is written to (resident mode's `capture` is kept on purpose: its age, and its
    state when recaptured): the adapter runs as copies with the spec's options (`Adapter.with_options`), and the
    routes are only read.
    """
    backward = backward or _plain_backward
    options = dict(kernels=spec.kernels, checkpoint_min_tokens=spec.checkpoint_min_tokens, vocab_limit=spec.vocab_limit)
    adapter = (adapter or adapter_for(model)).with_options(**options)
    replay = None
    if indexer is not None:
        if not hasattr(adapter, "index_slot"):
            raise LongStrawError(f"indexer replay: {type(adapter).__name__} has no DSA indexer")
        lengths = [int(r.shape[0]) for r in responses]
        replay = IndexerReplay(indexer, lengths, int(tokens_P.shape[0]), adapter.index_slot)
    with RouteReplay(model) if routes is not None else nullcontext() as hooks:
        return _update(model, tokens_P, responses, objective, spec, adapter, capture, backward, (routes, hooks, replay))


def _update(model, tokens_P, responses, objective, spec, adapter, capture, backward, replays) -> UpdateMetrics:
    routes, hooks, indexer = replays
    _check_tokens("tokens_P", tokens_P)
    if not responses:
        raise LongStrawError("grpo_update: no responses")
    for i, r in enumerate(responses):
        _check_tokens(f"responses[{i}]", r)
    _check_no_dropout(model)
    if capture is not None and spec.mode != "resident":
        raise LongStrawError(f"a kept capture is only used in resident mode, not {spec.mode!r}")
    if spec.mode == "resident":
        if capture is None:
            raise LongStrawError("resident mode needs the kept capture (capture_prefix) passed back in")
        if not torch.equal(capture.tokens_P, tokens_P):
            raise LongStrawError("resident capture was taken for a different prompt")

    meter = PeakMeter(tokens_P.device) if spec.measure else None
    if meter is not None:
        meter.start()
    clock = _Clock(tokens_P.device, spec.measure)
    lengths = [int(r.shape[0]) for r in responses]
    budget, estimate = spec.replay_budget_bytes, adapter.replay_graph_bytes
    planned = adapter.plan_lengths(lengths)
    batches = plan_micro_batches(planned, budget, estimate, adapter.batched_replay, spec.checkpoint_min_tokens)
    # Prompt rows carry any response's routes; exact mode keeps what its prompt backward recomputes from.
    prompt_routes = positions_hook(hooks, routes, [0])
    prompt = adapter.with_options(on_positions=prompt_routes, keep_checkpoints=spec.mode == "exact")
    ref_logps, ref_s = _score_reference(model, adapter, prompt, tokens_P, responses, batches, spec, replays, clock)

    t0 = clock.now()
    age = 0
    if spec.mode == "resident":
        if spec.max_prefix_age and capture.age >= spec.max_prefix_age:
            capture.state = None  # free the stale prefix before the new one is allocated
            capture.state, capture.age = prompt.capture(tokens_P[:-1], spec.chunk_size), 0
        state, age = capture.state, capture.age
    else:
        state = prompt.capture(tokens_P[:-1], spec.chunk_size)
    grad = state.zeros_like() if spec.mode == "exact" else None
    capture_s = clock.since(t0)

    t0 = clock.now()
    replay = (adapter, model, tokens_P, responses, batches, objective, spec, state, grad, ref_logps, backward)
    loss, stats, graph_bytes, natives = _replay(*replay, replays)
    replay_s = clock.since(t0)

    t0 = clock.now()
    dkv_bytes = prompt_graph_bytes = 0
    if grad is not None:
        dkv_bytes = grad.nbytes
        meter_factory = None
        if spec.measure_graph:
            exclude = module_storages(model) | state.storages() | grad.storages()
            meter_factory = lambda: GraphMeter(exclude)
        prompt_graph_bytes = prompt.backward_prompt(
            tokens_P[:-1], state, grad, spec.chunk_size, meter_factory, backward=backward
        )
        del grad
    prompt_backward_s = clock.since(t0)
    if capture is not None:
        capture.age += 1

    return UpdateMetrics(
        mode=spec.mode,
        loss=loss,
        stats=stats,
        tokens=sum(int(r.shape[0]) for r in responses),
        responses=len(responses),
        peak_memory_bytes=meter.peak() if meter is not None else None,
        prefix_bytes=state.nbytes,
        dkv_bytes=dkv_bytes,
        graph_bytes_max=graph_bytes,
        prompt_graph_bytes_max=prompt_graph_bytes,
        prefix_age=age,
        capture_s=capture_s,
        ref_s=ref_s,
        replay_s=replay_s,
        prompt_backward_s=prompt_backward_s,
        micro_batches=len(batches),
        native_routes=tuple(natives) if natives is not None else None,
        indexer_replayed=int(indexer.replayed) if indexer is not None else 0,
        indexer_mismatched=int(indexer.mismatched) if indexer is not None else 0,
    )


def _rows_options(replays, rows: list[int], count: bool = True) -> dict:
    """The adapter options of a forward over responses `rows`: their route window hook and indexer replay."""
    routes, hooks, indexer = replays
    options = dict(on_positions=positions_hook(hooks, routes, rows))
    if indexer is not None:
        options["index_replay"] = indexer.for_rows(rows, count)
    return options


def _score_reference(model, adapter, prompt, tokens_P, responses, batches, spec, replays, clock):
    """Reference logprobs per response (adapter disabled, no graph), from its own capture, freed before returning.
    Recorded selections are replayed here too (uncounted), as routes are."""
    if not spec.need_ref:
        return [None] * len(responses), 0.0 if spec.measure else None
    if not hasattr(model, "disable_adapter"):
        raise LongStrawError("need_ref: the model has no disable_adapter() (not a PEFT model)")
    t0 = clock.now()
    ref_logps = [None] * len(responses)
    with model.disable_adapter(), torch.no_grad():
        ref_state = prompt.with_options(keep_checkpoints=False).capture(tokens_P[:-1], spec.chunk_size)
        for rows in batches:
            rows_adapter = adapter.with_options(**_rows_options(replays, rows, count=False))
            scored = score_responses(
                rows_adapter, tokens_P, [responses[i] for i in rows], ref_state, None, 0, spec.temperature
            )
            for i, logp_R in zip(rows, scored, strict=True):
                ref_logps[i] = logp_R
    del ref_state
    return ref_logps, clock.since(t0)


def _replay(adapter, model, tokens_P, responses, batches, objective, spec, state, grad, ref_logps, backward, replays):
    """Micro-batches of responses with autograd: one forward, the objective of each response, one backward of their
    sum; each graph is freed by its backward before the next micro-batch runs. Returns (loss sum, stats sums,
    largest metered graph, per-response native routes or None)."""
    constant_rows = 0 if spec.mode == "exact" else 1
    exclude = set()
    if spec.measure_graph:
        exclude = module_storages(model) | state.storages() | (grad.storages() if grad is not None else set())
    hooks = replays[1]
    natives = [None] * len(responses) if hooks is not None else None
    loss_sum, stats_sum, graph_bytes = 0.0, {}, 0
    for b, rows in enumerate(batches):
        rows_adapter = adapter.with_options(**_rows_options(replays, rows))
        group = [responses[i] for i in rows]
        meter = GraphMeter(exclude) if spec.measure_graph else None
        with meter if meter is not None else nullcontext():
            logps = score_responses(rows_adapter, tokens_P, group, state, grad, constant_rows, spec.temperature)
            if natives is not None:
                for i, native_R_L_K in zip(rows, native_routes(hooks, [len(r) for r in group]), strict=True):
                    natives[i] = native_R_L_K
            results = [objective(i, logp_R, ref_logps[i]) for i, logp_R in zip(rows, logps, strict=True)]
        if meter is not None:
            graph_bytes = max(graph_bytes, meter.nbytes)
        live = [loss for loss, _ in results if isinstance(loss, torch.Tensor) and loss.requires_grad]
        if live:
            backward(live[0] if len(live) == 1 else sum(live), grad is None and b == len(batches) - 1, False)
        for loss, stats in results:
            loss_sum += float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
            for key, value in stats.items():
                stats_sum[key] = stats_sum.get(key, 0.0) + float(value)
        del logps, results, live
    return loss_sum, stats_sum, graph_bytes, natives


def _check_tokens(name: str, tokens: torch.Tensor) -> None:
    if tokens.dim() != 1 or tokens.shape[0] < 1 or tokens.dtype != torch.long:
        raise LongStrawError(f"{name}: expected a non-empty 1-D int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}")


def _check_no_dropout(model: nn.Module) -> None:
    """Capture, replays and exact mode's recompute must compute one function: active dropout would break that."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.training and module.p > 0:
            raise LongStrawError(
                f"{name} is an active dropout (p={module.p}); LongStraw only runs dropout-free forwards"
            )


class _Clock:
    """Phase timings. On CUDA each reading synchronizes first, so a phase's queued kernels count in its time; with
    `on` False nothing is read or synchronized and every duration is None."""

    def __init__(self, device: torch.device, on: bool):
        self.device, self.on = torch.device(device), on

    def now(self) -> float:
        if not self.on:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def since(self, t0: float) -> float | None:
        return self.now() - t0 if self.on else None
