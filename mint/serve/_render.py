"""Decoded choices -> OpenAI response objects: whole responses, and the chunks of a stream.

Logprobs are the engine's: log softmax(logits / T) in fp32 at each token (T = 1 for greedy), and the top-k
alternatives of that same distribution (not truncated by top_p). Completions list them as
{piece: logprob} with the sampled token added (so up to k + 1 entries, as OpenAI does); chat lists exactly the top k.

Routed experts use vLLM's encoding (the `routed_experts` field of a choice in vLLM after v0.21.0, vllm-project/vllm
PR #39568): one array [P+R-1, L, k] for the whole sequence, prompt rows first (row i = the routing of the forward over
input position i; the last token was never fed, so it has none), L = every decoder layer with a dense layer's rows
zero (vLLM sizes its capture buffer by the total layer count), uint8 up to 256 experts else uint16, saved with
`numpy.save` and base64-encoded. vLLM returns them on whole responses only, and so does this server.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from longstraw.routing import ExpertLayout
from mint.serve._api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    MintInfo,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from mint.serve._decode import Choice, Delta, Done


def encode_routes(prompt_routes: list, routes: list, layout: ExpertLayout) -> str:
    """vLLM's `routed_experts`: base64 of the `.npy` bytes of prompt_routes [P-1][L_moe][k] + routes [R][L_moe][k]
    spread over every decoder layer ([P+R-1, L, k], zeros at dense layers, as vLLM leaves them), uint8 while
    `layout.num_experts` <= 256, else uint16. Decode: np.load(io.BytesIO(b64decode(s)))."""
    moe_S_L_K = np.asarray(prompt_routes + routes, dtype=np.int64).reshape(-1, layout.num_layers, layout.top_k)
    dtype = np.uint8 if layout.num_experts <= 256 else np.uint16
    rows_S_L_K = np.zeros((moe_S_L_K.shape[0], layout.decoder_layers, layout.top_k), dtype=dtype)
    rows_S_L_K[:, list(layout.moe_layer_ids)] = moe_S_L_K
    buf = io.BytesIO()
    np.save(buf, rows_S_L_K, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class Pieces:
    """Token id -> its text as a lone token (special tokens spelled out), cached: logprob listings need it per
    token per alternative."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        piece = self.cache.get(token)
        if piece is None:
            piece = self.cache[token] = self.tokenizer.decode([token])
        return piece


@dataclass
class Renderer:
    """Everything one response needs besides the choices: the kind, ids, the request's model, usage counters."""

    chat: bool
    model: str
    revision: str | None
    seed: int
    pieces: Pieces
    top_k: int | None  # None: no logprobs; else alternatives per token
    prompts: list[list[int]]
    layout: ExpertLayout | None = None  # the base's routed experts (routes are encoded over all decoder layers)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    sent: dict[int, str] = field(default_factory=dict)  # streamed text per choice
    offsets: dict[int, int] = field(default_factory=dict)  # streamed text offset per choice (completions logprobs)

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prompts)
        return Usage(
            prompt_tokens=prompt, completion_tokens=self.completion_tokens, total_tokens=prompt + self.completion_tokens
        )

    def mint(self) -> MintInfo:
        return MintInfo(revision=self.revision, seed=self.seed)

    # ---- logprobs -----------------------------------------------------------------------------------------------

    def _chat_logprobs(self, ids, lps, tops) -> ChatLogprobs:
        content = []
        for j, (t, lp) in enumerate(zip(ids, lps, strict=True)):
            piece = self.pieces(t)
            alts = [
                TopLogprob(token=self.pieces(a), logprob=alp, bytes=list(self.pieces(a).encode()))
                for a, alp in (tops[j] if tops else [])
            ]
            content.append(TokenLogprob(token=piece, logprob=lp, bytes=list(piece.encode()), top_logprobs=alts))
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, ids, lps, tops, offset: int = 0) -> CompletionLogprobs:
        pieces = [self.pieces(t) for t in ids]
        offsets, top = [], []
        for j, lp in enumerate(lps):
            offsets.append(offset)
            offset += len(pieces[j])
            alts = {self.pieces(a): alp for a, alp in (tops[j] if tops else [])}
            alts[pieces[j]] = lp  # the sampled token is always listed (its value wins a shared key)
            top.append(alts)
        return CompletionLogprobs(tokens=pieces, token_logprobs=list(lps), top_logprobs=top, text_offset=offsets)

    # ---- whole responses ----------------------------------------------------------------------------------------

    def response(self, choices: list[Choice], done: Done) -> Completion | ChatCompletion:
        out = []
        for c in choices:
            self.completion_tokens += len(c.token_ids)
            routes = None
            if c.routes is not None:
                routes = encode_routes(done.prompt_routes[c.prompt_index] or [], c.routes, self.layout)
            extras = dict(
                stop_reason=c.stop_reason,
                token_ids=c.token_ids,
                prompt_token_ids=done.prompts[c.prompt_index],
                routed_experts=routes,
            )
            if self.chat:
                logprobs = None if self.top_k is None else self._chat_logprobs(c.token_ids, c.logprobs, c.top)
                message = AssistantMessage(content=c.text)
                out.append(
                    ChatChoice(
                        index=c.index, message=message, logprobs=logprobs, finish_reason=c.finish_reason, **extras
                    )
                )
            else:
                logprobs = None if self.top_k is None else self._completion_logprobs(c.token_ids, c.logprobs, c.top)
                out.append(
                    CompletionChoice(
                        index=c.index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason, **extras
                    )
                )
        kind = ChatCompletion if self.chat else Completion
        return kind(
            id=self.id, created=self.created, model=self.model, choices=out, usage=self.usage(), mint=self.mint()
        )

    # ---- streams ------------------------------------------------------------------------------------------------

    def _chunk(self, choice: dict) -> ChatCompletionChunk | Completion:
        if self.chat:
            return ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[ChatChunkChoice(**choice)]
            )
        return Completion(id=self.id, created=self.created, model=self.model, choices=[CompletionChoice(**choice)])

    def opening(self, done: Done, n: int) -> list:
        """One chunk per choice before its tokens: the assistant role (chat) and prompt_token_ids."""
        chunks = []
        for p, prompt in enumerate(done.prompts):
            for r in range(n):
                extras = dict(prompt_token_ids=prompt)
                if self.chat:
                    chunks.append(
                        self._chunk(dict(index=p * n + r, delta=ChatDelta(role="assistant", content=""), **extras))
                    )
                else:
                    chunks.append(self._chunk(dict(index=p * n + r, text="", **extras)))
        return chunks

    def delta(self, d: Delta) -> ChatCompletionChunk | Completion:
        self.completion_tokens += 1
        self.sent[d.index] = self.sent.get(d.index, "") + d.text
        extras = dict(token_ids=[d.token_id])
        tops = None if d.top is None else [d.top]
        if self.chat:
            logprobs = None if self.top_k is None else self._chat_logprobs([d.token_id], [d.logprob], tops)
            return self._chunk(dict(index=d.index, delta=ChatDelta(content=d.text), logprobs=logprobs, **extras))
        logprobs = None
        if self.top_k is not None:
            offset = self.offsets.get(d.index, 0)
            logprobs = self._completion_logprobs([d.token_id], [d.logprob], tops, offset)
            self.offsets[d.index] = offset + len(logprobs.tokens[0])
        return self._chunk(dict(index=d.index, text=d.text, logprobs=logprobs, **extras))

    def finish(self, c: Choice) -> ChatCompletionChunk | Completion:
        """The closing chunk of one choice: text held back so far (never part of a stop string), finish_reason."""
        sent = self.sent.get(c.index, "")
        rest = c.text[len(sent) :] if c.text.startswith(sent) else ""
        if self.chat:
            delta = ChatDelta(content=rest)
            return self._chunk(
                dict(index=c.index, delta=delta, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            )
        return self._chunk(dict(index=c.index, text=rest, finish_reason=c.finish_reason, stop_reason=c.stop_reason))

    def usage_chunk(self) -> ChatCompletionChunk | Completion:
        kind = ChatCompletionChunk if self.chat else Completion
        return kind(
            id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage(), mint=self.mint()
        )
