"""The FastAPI app of `mint serve`: routes, request checks, and the wait for the decode worker.

Bodies are read here rather than by FastAPI's injection, so that every failure is an OpenAI-style 4xx with a
message: a body over `max_body` (413), one that does not arrive within `read_timeout` (408; a client that promises
more bytes than it sends cannot hold a handler), bad JSON, wrong types, NaN, unknown or unimplemented parameters
(400). Socket-level garbage (a Content-Length that is not a number) never reaches the app: uvicorn answers it.
Every 5xx is logged with its traceback on the server's stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mint.errors import ConfigError
from mint.rollout import SamplingParams
from mint.serve._api import (
    ChatRequest,
    CompletionRequest,
    HttpError,
    LoadLoraRequest,
    ModelCard,
    ModelList,
    UnloadLoraRequest,
    validation_error,
)
from mint.serve._decode import Job
from mint.serve._model import AdapterHost
from mint.serve._render import Pieces, Renderer
from mint.serve._sched import Scheduler

log = logging.getLogger("mint.serve")


def _json(model: BaseModel | dict, status: int = 200) -> Response:
    if isinstance(model, dict):
        return JSONResponse(model, status_code=status)
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _sse(model: BaseModel | dict) -> str:
    data = json.dumps(model) if isinstance(model, dict) else model.model_dump_json()
    return f"data: {data}\n\n"


def _guarded(fn):
    """HttpError -> its status and message; anything else -> 500, traceback logged."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except HttpError as err:
            if err.status >= 500:
                log.error("%s: %s", err.status, err.message)
            headers = {"Retry-After": "1"} if err.status in (429, 503) else None
            return JSONResponse(err.body(), status_code=err.status, headers=headers)
        except Exception:
            log.exception("request failed")
            return JSONResponse(HttpError(500, "internal error (logged on the server)").body(), status_code=500)

    return wrapper


class Api:
    """The request side: checks, tokenization, jobs, responses."""

    def __init__(
        self,
        host: AdapterHost,
        sched: Scheduler,
        *,
        max_body: int,
        read_timeout: float,
        request_timeout: float,
        max_tokens: int,
        max_n: int,
        return_routes: bool = False,
    ):
        self.host, self.sched = host, sched
        self.max_body, self.read_timeout, self.request_timeout = max_body, read_timeout, request_timeout
        self.max_tokens, self.max_n = max_tokens, max_n
        # --enable-return-routed-experts: every whole response of an MoE base carries routes, as in vLLM
        self.return_routes = return_routes and host.layout is not None
        self.pieces = Pieces(host.tokenizer)

    async def body(self, request: Request, kind: type[BaseModel]):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise HttpError(413, f"request body of {length} bytes is over the {self.max_body}-byte limit")

        async def read() -> bytes:
            data = bytearray()
            async for chunk in request.stream():
                data += chunk
                if len(data) > self.max_body:
                    raise HttpError(413, f"request body is over the {self.max_body}-byte limit")
            return bytes(data)

        try:
            data = await asyncio.wait_for(read(), self.read_timeout)
        except asyncio.TimeoutError:
            raise HttpError(408, f"request body did not arrive within {self.read_timeout:g} s") from None
        except ClientDisconnect:  # nobody will read the answer; not a server error
            raise HttpError(499, "client closed the connection while sending the body") from None
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as err:
            raise HttpError(400, f"body is not JSON ({str(err)[:80]})") from None
        if not isinstance(obj, dict):
            raise HttpError(400, f"body must be a JSON object, got {type(obj).__name__}")
        try:
            return kind.model_validate(obj)
        except ValidationError as err:
            raise validation_error(err) from None

    # ---- requests -> jobs ---------------------------------------------------------------------------------------

    def check(self, req) -> None:
        bad = req.unsupported()
        if bad:
            raise HttpError(
                400, f"unsupported parameters: {', '.join(bad)} (mint serve does not implement them)", bad[0]
            )
        if req.stream_options is not None and not req.stream:
            raise HttpError(400, "stream_options: only allowed with stream=true", "stream_options")
        if req.return_routed_experts and self.host.layout is None:
            raise HttpError(400, "return_routed_experts: the base is dense; it has no routers", "return_routed_experts")
        if req.return_routed_experts and req.stream:
            raise HttpError(
                400,
                "return_routed_experts: routes come on whole responses only (as in vLLM); set stream=false",
                "return_routed_experts",
            )

    def tokens(self, prompt) -> list[int]:
        ids = self.host.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt
        if not ids or not all(0 <= t < self.host.vocab for t in ids):
            raise HttpError(400, f"prompt: empty, or token ids outside [0, {self.host.vocab})", "prompt")
        return list(ids)

    def chat_tokens(self, req: ChatRequest) -> list[int]:
        """The chat-templated prompt ending with the assistant header, as `mint.rollout.prompts.prompt_tokens`
        builds it. `developer` is the newer name of `system`."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.host.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # the template's own refusal (a role it does not know, ...)
            raise HttpError(400, f"messages: the chat template refused them ({str(err)[:120]})", "messages") from None
        return self.tokens(text)

    def job(self, req, prompts: list[list[int]], max_tokens: int | None, top_k: int | None, rid: str | None) -> Job:
        """A job for `req`. Without max_tokens, completions get 16 (OpenAI's default) and chat gets the rest of
        the context, up to --max-tokens (what OpenAI and vLLM do)."""
        longest = max(len(p) for p in prompts)
        if max_tokens is None and isinstance(req, ChatRequest):
            max_tokens = max(1, min(self.max_tokens, (self.host.max_context or self.max_tokens) - longest))
        max_tokens = 16 if max_tokens is None else max_tokens
        if len(prompts) > 1 and not self.host.batchable:
            raise HttpError(
                400, "prompt: this base has sliding-window attention; send one prompt per request", "prompt"
            )
        if max_tokens > self.max_tokens:
            raise HttpError(400, f"max_tokens: at most {self.max_tokens}, got {max_tokens}", "max_tokens")
        n = 1 if req.n is None else req.n
        if n > self.max_n:
            raise HttpError(400, f"n: at most {self.max_n}, got {n}", "n")
        if self.host.max_context and longest + max_tokens > self.host.max_context:
            raise HttpError(
                400,
                f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceed the context of {self.host.max_context}",
            )
        stop_ids = req.stop_token_ids or []
        if any(not 0 <= t < self.host.vocab for t in stop_ids):
            raise HttpError(400, f"stop_token_ids: ids must lie in [0, {self.host.vocab})", "stop_token_ids")
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                max_tokens=max_tokens,
                stop_token_ids=tuple(stop_ids),
            )
        except ConfigError as err:
            raise HttpError(400, str(err)) from None
        seed = int.from_bytes(os.urandom(8), "little") % 2**63 if req.seed is None else req.seed
        return Job(
            revision=rid,
            prompts=prompts,
            n=n,
            params=params,
            seed=seed,
            stop=req.stops(),
            ignore_eos=bool(req.ignore_eos),
            top_logprobs=top_k or 0,
            want_routes=bool(req.return_routed_experts) or (self.return_routes and not req.stream),
            stream=bool(req.stream),
            deadline=time.monotonic() + self.request_timeout,
        )

    # ---- running a job ------------------------------------------------------------------------------------------

    async def run(self, request: Request, req, job: Job, renderer: Renderer) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: tuple) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the server is shutting down
                loop.call_soon_threadsafe(events.put_nowait, event)

        job.emit = emit
        self.sched.submit(job)  # 429 before any byte of a stream is sent
        if job.stream:
            return StreamingResponse(self._stream(job, events, renderer, req), media_type="text/event-stream")
        event = await self._next(events, job, request)
        if event[0] == "error":
            raise event[1]
        return _json(renderer.response(event[1], event[2]))

    async def _next(self, events: asyncio.Queue, job: Job, request: Request | None = None) -> tuple:
        """The job's next event; a 504 once its deadline passes; for a whole response also notices the client
        leaving (streams are cancelled by Starlette instead)."""
        get = asyncio.ensure_future(events.get())
        waits = {get}
        if request is not None:
            waits.add(asyncio.ensure_future(_disconnected(request)))
        try:
            done, _ = await asyncio.wait(
                waits, timeout=max(0.0, job.deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits - {get}:
                w.cancel()
        if get in done:
            return get.result()
        get.cancel()
        self.sched.cancel(job)
        if done:  # the client went away; nobody reads this answer
            return ("error", HttpError(499, "client closed the request"))
        return ("error", HttpError(504, f"request timed out after {self.request_timeout:g} s"))

    async def _stream(self, job: Job, events: asyncio.Queue, renderer: Renderer, req):
        """SSE: the chunks of one decode step go out in one write."""
        finished = False
        try:
            while True:
                event = await self._next(events, job)
                kind = event[0]
                if kind == "admitted":
                    yield "".join(_sse(chunk) for chunk in renderer.opening(event[1], job.n))
                elif kind == "delta":
                    yield "".join(_sse(renderer.delta(d)) for d in event[1])
                elif kind == "choice":
                    yield _sse(renderer.finish(event[1]))
                elif kind == "done":
                    if req.stream_options is not None and req.stream_options.include_usage:
                        yield _sse(renderer.usage_chunk())
                    break
                else:  # error
                    log.warning("stream ended by %s: %s", event[1].status, event[1].message)
                    yield _sse(event[1].body())
                    break
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.sched.cancel(job)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is already read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(host: AdapterHost, sched: Scheduler, **limits) -> FastAPI:
    api = Api(host, sched, **limits)
    app = FastAPI(title="mint serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(
            HttpError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").body(),
            status_code=exc.status_code,
        )

    @app.get("/health")
    @_guarded
    async def health():
        return _json({"status": "ok", "waiting": sched.waiting(), **sched.stats})

    @app.get("/v1/models")
    @_guarded
    async def models():
        return _json(ModelList(data=[ModelCard(**m) for m in host.models()]))

    @app.get("/v1/models/{model_id:path}")
    @_guarded
    async def model(model_id: str):
        for m in host.models():
            if m["id"] == model_id:
                return _json(ModelCard(**m))
        raise HttpError(404, f"model {model_id!r} is not served", "model")

    @app.post("/v1/load_lora_adapter")
    @_guarded
    async def load(request: Request):
        req = await api.body(request, LoadLoraRequest)
        ref = req.lora_path or req.revision
        if ref is None:
            raise HttpError(400, "lora_path: required (a catalog ref or an exported directory)", "lora_path")
        if "\0" in ref:
            raise HttpError(400, "lora_path: contains a NUL byte", "lora_path")
        return _json(await asyncio.to_thread(host.load, req.lora_name, ref, req.load_inplace))

    @app.post("/v1/unload_lora_adapter")
    @_guarded
    async def unload(request: Request):
        req = await api.body(request, UnloadLoraRequest)
        return _json(await asyncio.to_thread(host.unload, req.lora_name))

    @app.post("/v1/completions")
    @_guarded
    async def completions(request: Request):
        req = await api.body(request, CompletionRequest)
        api.check(req)
        rid = host.resolve_model(req.model)
        prompts = [api.tokens(p) for p in req.prompt]
        job = api.job(req, prompts, req.max_tokens, req.logprobs, rid)
        renderer = Renderer(False, req.model, rid, job.seed, api.pieces, req.logprobs, prompts, host.layout)
        return await api.run(request, req, job, renderer)

    @app.post("/v1/chat/completions")
    @_guarded
    async def chat(request: Request):
        req = await api.body(request, ChatRequest)
        api.check(req)
        if req.top_logprobs and not req.logprobs:
            raise HttpError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
            raise HttpError(400, "max_tokens and max_completion_tokens differ; set one", "max_completion_tokens")
        rid = host.resolve_model(req.model)
        prompt = api.chat_tokens(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        job = api.job(req, [prompt], max_tokens, top_k, rid)
        renderer = Renderer(True, req.model, rid, job.seed, api.pieces, top_k, [prompt], host.layout)
        return await api.run(request, req, job, renderer)

    return app
