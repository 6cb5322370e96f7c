"""The OpenAI (and vLLM LoRA) request and response shapes `mint serve` speaks, as pydantic models.

Requests validate strictly: a string is not a number, a bool is not an integer, NaN and infinity are refused, and
every field the server does not implement is named in one 400 instead of being ignored. A field counts as set when
it is present and not null; a few are accepted at their no-op value (`frequency_penalty: 0`, `tools: []`, ...).
Responses follow the OpenAI objects plus vLLM's extras (`token_ids`, `prompt_token_ids`, `stop_reason`,
`routed_experts`) and ours (`mint`). `routed_experts` has vLLM's encoding (docs/rollout.md): the base64 of a `.npy`
array [P+R-1, L, k] of expert ids (uint8, or uint16 past 256 experts), on whole responses only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16

# Parameters of the OpenAI and vLLM APIs this server does not implement, with the values that mean "off".
NOOP_VALUES: dict[str, tuple] = {
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (),
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "store": (False,),
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "prompt_logprobs": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "service_tier": ("auto", "default"),
}


_KINDS = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error", 408: "timeout_error"}
_KINDS |= {413: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


class HttpError(Exception):
    """A request that gets an OpenAI-style error object: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        kind = _KINDS.get(self.status, "internal_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def validation_error(err: ValidationError) -> HttpError:
    """One 400 that names every bad field."""
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "body"
        got = repr(e.get("input"))
        parts.append(f"{where}: {e['msg'].removeprefix('Value error, ')} (got {got[:60]})")
    first = ".".join(str(x) for x in err.errors()[0]["loc"]) if err.errors() else None
    return HttpError(400, "; ".join(parts), first)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    n: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None  # vLLM's; token_ids and prompt_token_ids are always returned
    # SGLang's request field, read here as a per-request `--enable-return-routed-experts` (vLLM has no such field)
    return_routed_experts: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > MAX_STOPS or any(not s for s in stops)):
            raise ValueError(f"expected up to {MAX_STOPS} non-empty strings")
        return v

    def unsupported(self) -> list[str]:
        """Every field set in the request that the server does not implement (unknown ones included)."""
        bad = []
        for key, value in (self.model_extra or {}).items():
            if value is None or value in NOOP_VALUES.get(key, ()):
                continue
            if key == "parallel_tool_calls" and not (self.model_extra or {}).get("tools"):
                continue  # means nothing without tools
            bad.append(key)
        return sorted(bad)

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool | None = None


class CompletionRequest(_Request):
    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str) and v:
            return [v]
        if isinstance(v, list) and v and all(type(t) is int for t in v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) and p for p in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in v):
            return v
        raise ValueError("expected non-empty text, a list of token ids, or a non-empty list of either")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list):
            kinds = sorted({p.get("type") for p in v if isinstance(p, dict)} - {"text"}, key=str)
            if kinds:
                raise ValueError(f"content parts of type {', '.join(map(str, kinds))} are not supported (text only)")
        return v

    def text(self) -> str:
        """Text parts are joined with newlines, as vLLM does for string chat templates."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str | None = Field(None, min_length=1)
    revision: str | None = Field(None, min_length=1)  # ours; an alias of lora_path
    load_inplace: bool = False
    lora_int_id: int | None = None  # vLLM's; accepted and unused (adapters are keyed by name)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ---- responses ------------------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class MintInfo(BaseModel):
    revision: str | None
    seed: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mint"
    root: str
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


def _omit_none(v) -> bool:
    return v is None


class _ChoiceExtras(BaseModel):
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_omit_none)
    routed_experts: str | None = Field(None, exclude_if=_omit_none)  # base64 .npy [P+R-1, L, k] (vLLM's encoding)


class CompletionChoice(_ChoiceExtras):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_omit_none)
    mint: MintInfo | None = Field(None, exclude_if=_omit_none)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_ChoiceExtras):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    mint: MintInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_ChoiceExtras):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_omit_none)
    mint: MintInfo | None = Field(None, exclude_if=_omit_none)


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()
