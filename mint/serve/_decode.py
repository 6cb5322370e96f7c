"""The server's decode batch: many requests for one revision sampled together, each exactly as the rollout engine
would sample it alone.

A request (`Job`) holds one or more prompts; each prompt is a group of n rows, as in `RolloutEngine.generate_group`:

    admit    prefill the prompt at batch 1 into its own cache (the engine's `_prefill`), repeat it to n rows, and
             merge it into the running batch: every cache is left-padded to the longest, the padding masked
    step     each group draws its next tokens from its own logits with its own generator (the engine's `sample_next`
             and `token_logprobs`), finished rows are answered, finished groups leave the batch, and one forward
             over every remaining row produces the next logits

Seeds. Group i of a job has its own generator seeded with `group_seed(seed, i)`, as the engine seeds group i of a
call, and draws, per step, for its n rows exactly as the engine draws for a group (finished rows keep drawing, so a
row's tokens never depend on when its siblings stop). A neighbour in the batch never touches that generator. So a
request draws what `RolloutEngine.generate(prompts, n, params, seed)` draws: bit for bit for one prompt running
alone (no padding: the same forwards), and within float reassociation when padded or batched (the padded
attention and larger matmuls sum in another order, about 1e-6 in the logprobs; a token can differ only if a draw
lands that close to a boundary).

Stop strings are checked on the text as it grows (incremental detokenization); a row that completes one ends with
finish_reason "stop", keeps the tokens up to and including the one that completed it, and its text is cut before
the stop string. Until then, a streamed row holds back the last len(longest stop) - 1 characters, so no part of a
stop string is ever sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from longstraw.routing import RouteRecorder
from longstraw.scoring import token_logprobs
from mint.models.specs import moe_layout, usable_vocab
from mint.rollout import SamplingParams
from mint.rollout.engine import group_seed, sample_next  # the engine's own draw and seeds: one implementation

SEED_MOD = 2**63


@dataclass(eq=False)  # compared by identity: two identical requests are still two jobs
class Job:
    """One request: n samples for each of its prompts, over one revision (None = the base)."""

    revision: str | None
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    seed: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives per token (0: none)
    want_routes: bool = False
    stream: bool = False
    deadline: float = math.inf  # time.monotonic() after which the job is dropped
    emit: Callable[[tuple], None] = lambda event: None  # thread-safe sink for ("delta"|"choice"|"done"|"error", ...)
    cancelled: bool = False


@dataclass
class Delta:
    """One streamed token of one choice."""

    index: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None
    route_L_K: list | None
    text: str


@dataclass
class Choice:
    """One finished completion."""

    index: int  # prompt_index * n + row
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    routes: list | None  # [R][L][k] expert ids
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None  # the stop string or stop token id that ended it (vLLM's field)


@dataclass
class Done:
    """Everything a job produced besides its choices."""

    prompts: list[list[int]]
    prompt_routes: list[list | None]  # per prompt: [P-1][L][k] expert ids of prompt positions 0..P-2


class _Text:
    """Incremental detokenization: decode a short window and append only whole characters (a window that ends
    inside a multi-byte character decodes to U+FFFD and waits for the next token)."""

    def __init__(self, tokenizer, holdback: int):
        self.tokenizer, self.holdback = tokenizer, holdback
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.sent = 0  # characters already streamed
        self.stop: str | None = None  # the stop string that ended the row

    def push(self, token_id: int) -> int:
        """Append a token; returns the offset where new text starts (len(text) before)."""
        start = len(self.text)
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        return start

    def take(self, final: bool = False) -> str:
        """Text that can be streamed now: all but the held-back tail (all of it once the row is `final`)."""
        limit = len(self.text) if final else max(self.sent, len(self.text) - self.holdback)
        out, self.sent = self.text[self.sent : limit], limit
        return out


@dataclass
class _Group:
    """One prompt of a job: G = job.n rows decoded together, with their own generator."""

    job: Job
    prompt_index: int
    generator: torch.Generator
    logits_G_V: torch.Tensor  # logits the next draw samples from
    routes_G_L_K: torch.Tensor | None  # routing of the forward that produced them (route row of the next token)
    stop_ids: frozenset[int]
    next_G: torch.Tensor | None = None
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    tops: list[list[list[tuple[int, float]]]] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # per step [G, L, k]
    texts: list[_Text] | None = None
    done: list[bool] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.job.n


@dataclass
class _JobState:
    remaining: int  # groups not yet finished
    choices: list[Choice] = field(default_factory=list)
    prompt_routes: list = field(default_factory=list)


class BatchDecoder:
    """The running decode batch of one revision. Use as a context manager (route hooks live for its duration)."""

    def __init__(self, model: torch.nn.Module, eos_token_ids: tuple[int, ...], tokenizer):
        self.model, self.eos_ids, self.tokenizer = model, frozenset(eos_token_ids), tokenizer
        self.layout = moe_layout(model.config)
        # A padded head's rows past the tokenizer are never sampled, as in the rollout engine and the learner.
        self.vocab_limit = usable_vocab(len(tokenizer), model.config)
        self.device = next(model.parameters()).device
        self.groups: list[_Group] = []
        self.jobs: dict[int, tuple[Job, _JobState]] = {}  # id(job) -> job, state
        self.cache: DynamicCache | None = None
        self.mask_B_S: torch.Tensor | None = None  # int64, 0 = left padding
        self.pos_B: torch.Tensor | None = None  # next absolute position per row
        self._stack = ExitStack()
        self.recorder = None

    def __enter__(self) -> BatchDecoder:
        if self.layout is not None:
            self.recorder = self._stack.enter_context(RouteRecorder(self.model))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    # ---- admission ----------------------------------------------------------------------------------------------

    def admit(self, job: Job) -> None:
        """Prefill each prompt of `job` at batch 1 and merge its rows into the batch."""
        state = _JobState(remaining=len(job.prompts), prompt_routes=[None] * len(job.prompts))
        parts, groups = [], []
        stop_ids = frozenset(job.params.stop_token_ids) | (frozenset() if job.ignore_eos else self.eos_ids)
        with torch.inference_mode():
            for i, prompt in enumerate(job.prompts):
                cache = DynamicCache(config=self.model.config)
                logits_1_V, routes_1_P_L_K = self._forward(torch.tensor([prompt], device=self.device), cache)
                cache.batch_repeat_interleave(job.n)
                generator = torch.Generator(device=self.device)
                generator.manual_seed(group_seed(job.seed % SEED_MOD, i))
                first = None if routes_1_P_L_K is None else routes_1_P_L_K[:, -1].expand(job.n, -1, -1)
                group = _Group(job, i, generator, logits_1_V.expand(job.n, -1), first, stop_ids)
                group.tokens, group.logprobs = [[] for _ in range(job.n)], [[] for _ in range(job.n)]
                group.tops, group.done = [[] for _ in range(job.n)], [False] * job.n
                if job.stop or job.stream:
                    holdback = max((len(s) for s in job.stop), default=1) - 1
                    group.texts = [_Text(self.tokenizer, holdback) for _ in range(job.n)]
                if job.want_routes and routes_1_P_L_K is not None:
                    state.prompt_routes[i] = self._host_routes(routes_1_P_L_K[0, :-1])
                mask = torch.ones(job.n, len(prompt), dtype=torch.int64, device=self.device)
                parts.append(([(k, v) for k, v, *_ in cache], mask, torch.full_like(mask[:, 0], len(prompt))))
                groups.append(group)
        if self.cache is not None:
            parts.insert(0, ([(k, v) for k, v, *_ in self.cache], self.mask_B_S, self.pos_B))
        self.cache, self.mask_B_S, self.pos_B = self._merge(parts)
        self.groups += groups
        self.jobs[id(job)] = (job, state)
        if job.stream:
            job.emit(("admitted", Done(job.prompts, state.prompt_routes)))

    def _merge(self, parts: list) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Concatenate caches along the batch, each left-padded with zeros (masked) to the longest."""
        length = max(mask.shape[1] for _, mask, _ in parts)

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = length - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        num_layers = len(parts[0][0])
        data = [
            (torch.cat([pad(kv[i][0], 2) for kv, _, _ in parts]), torch.cat([pad(kv[i][1], 2) for kv, _, _ in parts]))
            for i in range(num_layers)
        ]
        mask = torch.cat([pad(m, 1) for _, m, _ in parts])
        pos = torch.cat([p for _, _, p in parts])
        return DynamicCache(ddp_cache_data=data, config=self.model.config), mask, pos

    # ---- one step -----------------------------------------------------------------------------------------------

    def step(self) -> None:
        """Draw one token per row, answer finished rows and jobs, then run one forward for the rows left."""
        with torch.inference_mode():
            self._sample_all()
            finished = [g for g in self.groups if all(g.done)]
            if finished:
                self._remove(finished)
                for g in finished:
                    self._group_done(g)
            if self.groups:
                self._forward_all()

    def _sample_all(self) -> None:
        nexts, lps = [], []
        for g in self.groups:
            params = g.job.params
            g.next_G = sample_next(g.logits_G_V, params, g.generator)
            nexts.append(g.next_G)
            lps.append(token_logprobs(g.logits_G_V, g.next_G, params.temperature if params.temperature > 0 else 1.0))
        tokens, lps = torch.cat(nexts).tolist(), torch.cat(lps).tolist()
        row = 0
        for g in self.groups:
            top = self._top(g) if g.job.top_logprobs else None
            live = [r for r in range(g.rows) if not g.done[r]]
            deltas = [self._record(g, r, tokens[row + r], lps[row + r], top[r] if top else None) for r in live]
            if g.routes_G_L_K is not None and g.job.want_routes:
                g.routes.append(g.routes_G_L_K.to(self.layout.route_dtype))
            row += g.rows
            if g.job.stream:
                g.job.emit(("delta", deltas))
                for r in live:
                    if g.done[r]:
                        g.job.emit(("choice", self._choice(g, r)))

    def _top(self, g: _Group) -> list[list[tuple[int, float]]]:
        """Top-k of log softmax(logits / T) per row: the same scaled logits and logsumexp as `token_logprobs`."""
        temperature = g.job.params.temperature if g.job.params.temperature > 0 else 1.0
        logits = g.logits_G_V.float()
        if temperature != 1.0:
            logits = logits / temperature
        values, ids = logits.topk(min(g.job.top_logprobs, logits.shape[-1]), dim=-1)
        values = values - torch.logsumexp(logits, dim=-1, keepdim=True)
        return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]

    def _record(self, g: _Group, r: int, token: int, logprob: float, top) -> Delta | None:
        g.tokens[r].append(token)
        g.logprobs[r].append(logprob)
        if top is not None:
            g.tops[r].append(top)
        text = ""
        stopped = token in g.stop_ids
        if g.texts is not None:
            tracker = g.texts[r]
            start = tracker.push(token)
            if g.job.stop and not stopped and len(tracker.text) > start:
                window = max(0, start - max(len(s) for s in g.job.stop) + 1)
                hits = [(i, s) for s in g.job.stop if (i := tracker.text.find(s, window)) >= 0]
                if hits:
                    cut, tracker.stop = min(hits)
                    tracker.text, stopped = tracker.text[:cut], True
        if stopped or len(g.tokens[r]) >= g.job.params.max_tokens:
            g.done[r] = True
        if g.texts is not None:
            text = g.texts[r].take(final=g.done[r])
        if not g.job.stream:
            return None
        route = None
        if g.job.want_routes and g.routes_G_L_K is not None:
            route = g.routes_G_L_K[r].tolist()
        return Delta(g.prompt_index * g.rows + r, token, logprob, top, route, text)

    def _choice(self, g: _Group, r: int) -> Choice:
        ids = g.tokens[r]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stop_string = g.texts[r].stop if g.texts is not None else None
        if stop_string is not None:
            cut = [i for s in g.job.stop if (i := text.find(s)) >= 0]
            text = text[: min(cut)] if cut else g.texts[r].text
            finish, reason = "stop", stop_string
        elif ids[-1] in g.stop_ids:
            finish, reason = "stop", ids[-1] if ids[-1] in g.job.params.stop_token_ids else None
        else:
            finish, reason = "length", None
        routes = None
        if g.routes:
            routes = torch.stack(g.routes[: len(ids)])[:, r].cpu().tolist()
        top = g.tops[r] if g.job.top_logprobs else None
        return Choice(
            g.prompt_index * g.rows + r, g.prompt_index, ids, g.logprobs[r], top, routes, text, finish, reason
        )

    def _group_done(self, g: _Group) -> None:
        job, state = self.jobs[id(g.job)]
        if not job.stream:
            state.choices += [self._choice(g, r) for r in range(g.rows)]
        state.remaining -= 1
        if state.remaining == 0:
            del self.jobs[id(job)]
            job.emit(("done", sorted(state.choices, key=lambda c: c.index), Done(job.prompts, state.prompt_routes)))

    def _forward_all(self) -> None:
        ids_B_1 = torch.cat([g.next_G for g in self.groups])[:, None]
        padded = bool((self.mask_B_S == 0).any())
        if padded:
            self.mask_B_S = torch.cat([self.mask_B_S, torch.ones_like(self.mask_B_S[:, :1])], dim=1)
            logits_B_V, routes_B_1_L_K = self._forward(ids_B_1, self.cache, self.mask_B_S, self.pos_B[:, None])
        else:  # no padding: exactly the engine's decode forward
            self.mask_B_S = self.mask_B_S.new_ones(self.mask_B_S.shape[0], self.mask_B_S.shape[1] + 1)
            logits_B_V, routes_B_1_L_K = self._forward(ids_B_1, self.cache)
        self.pos_B = self.pos_B + 1
        row = 0
        for g in self.groups:
            g.logits_G_V = logits_B_V[row : row + g.rows]
            g.routes_G_L_K = None if routes_B_1_L_K is None else routes_B_1_L_K[row : row + g.rows, 0]
            row += g.rows

    def _forward(self, ids_B_S: torch.Tensor, cache: DynamicCache, mask=None, pos=None):
        """One forward extending `cache`: ids [B, S] -> (last logits [B, V], routes [B, S, L, k] or None)."""
        extra = {} if mask is None else {"attention_mask": mask, "position_ids": pos}
        out = self.model(input_ids=ids_B_S, cache=cache, use_cache=True, logits_to_keep=1, **extra)
        routes = None if self.recorder is None else self.recorder.pop_batched(*ids_B_S.shape)
        return out.logits[:, -1, : self.vocab_limit], routes

    # ---- leaving the batch --------------------------------------------------------------------------------------

    def drop(self, job: Job) -> None:
        """Remove a cancelled or expired job's rows without answering it."""
        mine = [g for g in self.groups if g.job is job]
        if mine:
            self._remove(mine)
        self.jobs.pop(id(job), None)

    def _remove(self, leaving: list[_Group]) -> None:
        keep, row, kept = [], 0, []
        for g in self.groups:
            if not any(g is x for x in leaving):
                keep += range(row, row + g.rows)
                kept.append(g)
            row += g.rows
        self.groups = kept
        if not kept:
            self.cache = self.mask_B_S = self.pos_B = None
            return
        index = torch.tensor(keep, device=self.device)
        mask = self.mask_B_S[index]
        first = int(mask.any(0).nonzero()[0])  # columns that are padding in every row left are dropped
        data = [(k[index, :, first:], v[index, :, first:]) for k, v, *_ in self.cache]
        self.cache = DynamicCache(ddp_cache_data=data, config=self.model.config)
        self.mask_B_S, self.pos_B = mask[:, first:], self.pos_B[index]

    def _host_routes(self, routes_S_L_K: torch.Tensor) -> list:
        return routes_S_L_K.to(self.layout.route_dtype).cpu().tolist()

    @property
    def empty(self) -> bool:
        return not self.groups

    def active_jobs(self) -> list[Job]:
        return [job for job, _ in self.jobs.values()]
