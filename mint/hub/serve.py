"""`mint serve`: an OpenAI-compatible HTTP server on the built-in rollout engine, with revisions hot-loaded over
one frozen base.

Endpoints
    GET  /v1/models                  the base and every resident revision (vLLM lists LoRA modules the same way)
    POST /v1/completions             prompt: text, token ids, or a list of either; logprobs of the sampled tokens
    POST /v1/chat/completions        messages through the base tokenizer's chat template; logprobs on request
    POST /v1/load_lora_adapter       {"lora_name": NAME, "lora_path": REF}  (vLLM's shape; REF names a revision)
    POST /v1/unload_lora_adapter     {"lora_name": NAME}
    GET  /health

A request picks the base or a resident revision by `model` (its lora_name, or its revision id). Revisions load only
from the catalog, by id, id prefix, name or RUN@STEP: never from an arbitrary path, never through pickle, and only
after their tensors hash to their id and their base fingerprint matches the served base. Sampling and logprobs are
`mint.rollout.RolloutEngine`'s, so a served revision scores tokens exactly as the rollout actors and the learner do
(log softmax(logits / T) in fp32; T = 0 is greedy, scored at T = 1). Requests are served one at a time behind a
lock around the model (the HTTP side is threaded): correct under any concurrency, not a throughput server.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from mint.errors import MintError
from mint.hub.catalog import Catalog
from mint.rollout import RolloutEngine, SamplingParams

MAX_BODY = 1 << 20
BASE_ALIASES = ("base",)


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _int(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HttpError(400, f"{key}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _float(body: dict, key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HttpError(400, f"{key}: expected a number, got {value!r}")
    return float(value)


class AdapterServer:
    """The frozen base, the resident revisions (PEFT adapters over it), and generation. No HTTP here."""

    def __init__(
        self,
        base: str,
        catalog: Catalog,
        *,
        dtype: str = "float32",
        device: str | None = None,
        served_name: str | None = None,
        max_resident: int = 8,
        max_tokens: int = 4096,
        max_n: int = 64,
    ):
        from transformers import AutoTokenizer

        from mint.hub.revisions import base_fingerprint
        from mint.models.specs import load_model
        from mint.models.tiny import resolve_model_path

        self.base_path = resolve_model_path(base)
        self.catalog = catalog
        self.served_name = served_name or base
        self.limits = dict(max_resident=max_resident, max_tokens=max_tokens, max_n=max_n)
        self.fingerprint = base_fingerprint(self.base_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(self.base_path, dtype).to(device)
        eos = self.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        self.eos_ids = sorted(set(eos_ids))
        self.peft = None  # the PeftModel once a revision is resident
        self.engine = RolloutEngine(self.model, self.eos_ids)
        self.resident: dict[str, str] = {}  # lora_name -> revision id
        self.loaded_at: dict[str, float] = {}
        self._lock = threading.RLock()

    # ---- adapters -----------------------------------------------------------------------------------------------

    @staticmethod
    def _adapter(rid: str) -> str:
        return f"rev_{rid}"

    def load(self, lora_name: str, ref: str) -> dict:
        from peft import PeftModel, set_peft_model_state_dict

        from mint.hub.export import check_base, peft_lora_config

        if not isinstance(lora_name, str) or not lora_name or lora_name in (*BASE_ALIASES, self.served_name):
            raise HttpError(400, f"lora_name: {lora_name!r} is empty or names the base")
        if not isinstance(ref, str) or "/" in ref or ref.startswith((".", "~")):
            raise HttpError(400, f"{ref!r}: mint serve loads revisions only from its catalog (id, name or RUN@STEP)")
        try:
            rid = self.catalog.resolve(ref)
        except MintError as err:
            raise HttpError(404, str(err), "not_found_error") from None
        try:
            tensors, meta = self.catalog.load(rid)  # hash verified
            check_base(meta, self.base_path)
        except MintError as err:
            raise HttpError(400, str(err)) from None
        with self._lock:
            if lora_name in self.resident:
                if self.resident[lora_name] == meta.id:
                    return {"lora_name": lora_name, "revision": meta.id, "status": "already loaded"}
                raise HttpError(400, f"lora_name {lora_name!r} is loaded with another revision; unload it first")
            adapter = self._adapter(meta.id)
            if meta.id not in self.resident.values():
                if len(set(self.resident.values())) >= self.limits["max_resident"]:
                    raise HttpError(400, f"{self.limits['max_resident']} revisions are resident; unload one first")
                config = peft_lora_config(meta.lora_config)
                if self.peft is None:
                    self.peft = PeftModel(self.model, config, adapter_name=adapter)
                else:
                    self.peft.add_adapter(adapter, config)
                result = set_peft_model_state_dict(self.peft, tensors, adapter_name=adapter)
                if getattr(result, "unexpected_keys", None):
                    self._drop(adapter)
                    raise HttpError(
                        400, f"revision {meta.id[:12]} has keys this base lacks: {result.unexpected_keys[:2]}"
                    )
                self.peft.eval()
                self.engine = RolloutEngine(self.peft, self.eos_ids)
            self.resident[lora_name] = meta.id
            self.loaded_at[lora_name] = time.time()
        return {"lora_name": lora_name, "revision": meta.id, "status": "loaded"}

    def _drop(self, adapter: str) -> None:
        remaining = [a for a in self.peft.peft_config if a != adapter]
        if not remaining:  # PEFT cannot run with zero adapters: take the LoRA layers out again
            self.model = self.peft.unload()
            self.peft = None
            self.engine = RolloutEngine(self.model, self.eos_ids)
            return
        self.peft.set_adapter(remaining[0])
        self.peft.delete_adapter(adapter)

    def unload(self, lora_name: str) -> dict:
        with self._lock:
            if lora_name not in self.resident:
                raise HttpError(404, f"lora_name {lora_name!r} is not loaded", "not_found_error")
            rid = self.resident.pop(lora_name)
            self.loaded_at.pop(lora_name, None)
            if rid not in self.resident.values():
                self._drop(self._adapter(rid))
        return {"lora_name": lora_name, "revision": rid, "status": "unloaded"}

    def models(self) -> dict:
        now = int(time.time())
        data = [{"id": self.served_name, "object": "model", "created": now, "owned_by": "mint", "root": self.base_path}]
        with self._lock:
            for name, rid in sorted(self.resident.items()):
                data.append(
                    {
                        "id": name,
                        "object": "model",
                        "created": int(self.loaded_at.get(name, now)),
                        "owned_by": "mint",
                        "root": rid,
                        "parent": self.served_name,
                    }
                )
        return {"object": "list", "data": data}

    # ---- generation ---------------------------------------------------------------------------------------------

    def _target(self, model: Any) -> str | None:
        """The revision id a request's `model` names, or None for the base."""
        if model in BASE_ALIASES or model == self.served_name:
            return None
        if model in self.resident:
            return self.resident[model]
        if isinstance(model, str) and model in self.resident.values():
            return model
        raise HttpError(404, f"model {model!r} is not served; load it with /v1/load_lora_adapter", "not_found_error")

    def _params(self, body: dict) -> tuple[SamplingParams, int, int]:
        if body.get("stream"):
            raise HttpError(400, "stream: streaming is not supported")
        if body.get("echo"):
            raise HttpError(400, "echo: not supported")
        stop_ids = list(body.get("stop_token_ids") or [])
        stop = body.get("stop") or []
        for text in [stop] if isinstance(stop, str) else stop:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise HttpError(400, f"stop: {text!r} is {len(ids)} tokens; only single-token stops are supported")
            stop_ids.append(ids[0])
        try:
            params = SamplingParams(
                temperature=_float(body, "temperature", 1.0),
                top_p=_float(body, "top_p", 1.0),
                max_tokens=_int(body, "max_tokens", 16, 1, self.limits["max_tokens"]),
                stop_token_ids=tuple(stop_ids),
            )
        except MintError as err:
            raise HttpError(400, str(err)) from None
        n = _int(body, "n", 1, 1, self.limits["max_n"])
        seed = body.get("seed")
        seed = int.from_bytes(os.urandom(4), "little") if seed is None else _int(body, "seed", 0, 0, 2**63 - 1)
        return params, n, seed

    def _prompts(self, prompt: Any) -> list[list[int]]:
        vocab = len(self.tokenizer)
        token_list = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if isinstance(prompt, str) or token_list:
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise HttpError(400, "prompt: expected text, a list of token ids, or a non-empty list of those")
        out = []
        for p in prompts:
            ids = self.tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else p
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise HttpError(400, f"prompt: empty, or token ids outside [0, {vocab})")
            out.append(list(ids))
        return out

    def chat_tokens(self, messages: Any) -> list[int]:
        """The chat-templated prompt ending with the assistant header, as `rollout_actor.prompt_tokens` builds it."""
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages: expected a non-empty list of {role, content}")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise HttpError(400, "messages: each message needs a string role and string content")
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        text = self.tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _generate(self, model: Any, prompts: list[list[int]], params: SamplingParams, n: int, seed: int):
        with self._lock:
            rid = self._target(model)
            if rid is None:
                if self.peft is None:
                    return rid, self.engine.generate(prompts, n, params, seed)
                with self.peft.disable_adapter():
                    return rid, self.engine.generate(prompts, n, params, seed)
            self.peft.set_adapter(self._adapter(rid))
            return rid, self.engine.generate(prompts, n, params, seed)

    def complete(self, body: dict) -> dict:
        params, n, seed = self._params(body)
        prompts = self._prompts(body.get("prompt"))
        want_logprobs = body.get("logprobs") is not None and body.get("logprobs") is not False
        rid, groups = self._generate(body.get("model"), prompts, params, n, seed)
        choices, completion_tokens = [], 0
        for group in groups:
            for c in group.completions:
                ids = c.tokens_R.tolist()
                completion_tokens += len(ids)
                choice = {
                    "index": len(choices),
                    "text": self.tokenizer.decode(ids, skip_special_tokens=True),
                    "finish_reason": c.finish_reason,
                    "token_ids": ids,
                    "prompt_token_ids": group.prompt_tokens_P.tolist(),
                    "logprobs": None,
                }
                if want_logprobs:
                    pieces = [self.tokenizer.decode([t]) for t in ids]
                    lps = c.logprobs_R.tolist()
                    offsets, pos = [], 0
                    for piece in pieces:
                        offsets.append(pos)
                        pos += len(piece)
                    choice["logprobs"] = {
                        "tokens": pieces,
                        "token_logprobs": lps,
                        "top_logprobs": [{p: lp} for p, lp in zip(pieces, lps, strict=True)],
                        "text_offset": offsets,
                    }
                choices.append(choice)
        return self._envelope("cmpl", "text_completion", body, rid, choices, prompts, completion_tokens, seed)

    def chat(self, body: dict) -> dict:
        params, n, seed = self._params(body)
        prompt = self.chat_tokens(body.get("messages"))
        rid, groups = self._generate(body.get("model"), [prompt], params, n, seed)
        choices, completion_tokens = [], 0
        for c in groups[0].completions:
            ids = c.tokens_R.tolist()
            completion_tokens += len(ids)
            logprobs = None
            if body.get("logprobs"):
                logprobs = {
                    "content": [
                        {
                            "token": self.tokenizer.decode([t]),
                            "logprob": lp,
                            "bytes": list(self.tokenizer.decode([t]).encode()),
                            "top_logprobs": [],
                        }
                        for t, lp in zip(ids, c.logprobs_R.tolist(), strict=True)
                    ]
                }
            choices.append(
                {
                    "index": len(choices),
                    "message": {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)},
                    "finish_reason": c.finish_reason,
                    "logprobs": logprobs,
                    "token_ids": ids,
                    "prompt_token_ids": prompt,
                }
            )
        return self._envelope("chatcmpl", "chat.completion", body, rid, choices, [prompt], completion_tokens, seed)

    @staticmethod
    def _envelope(prefix, kind, body, rid, choices, prompts, completion_tokens, seed) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "mint": {"revision": rid, "seed": seed},
        }


def _handler(server: AdapterServer, verbose: bool):
    routes_get = {"/v1/models": server.models, "/health": lambda: {"status": "ok"}}
    routes_post = {
        "/v1/completions": server.complete,
        "/v1/chat/completions": server.chat,
        "/v1/load_lora_adapter": lambda b: server.load(b.get("lora_name"), b.get("lora_path") or b.get("revision")),
        "/v1/unload_lora_adapter": lambda b: server.unload(b.get("lora_name")),
    }

    class Handler(BaseHTTPRequestHandler):
        server_version = "mint-serve/1"

        def log_message(self, fmt, *args):
            if verbose:
                super().log_message(fmt, *args)

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, err: HttpError) -> None:
            self._send(err.status, {"error": {"message": err.message, "type": err.kind, "code": err.status}})

        def _run(self, fn) -> None:
            try:
                self._send(200, fn())
            except HttpError as err:
                self._error(err)
            except Exception as err:  # a bug must not kill the server; report it on this request only
                lines = str(err).splitlines()
                self._error(HttpError(500, f"{type(err).__name__}: {lines[0] if lines else ''}", "internal_error"))

        def do_GET(self):
            path = self.path.split("?")[0]
            if path not in routes_get:
                return self._error(HttpError(404, f"no route {path}", "not_found_error"))
            self._run(routes_get[path])

        def do_POST(self):
            path = self.path.split("?")[0]
            if path not in routes_post:
                return self._error(HttpError(404, f"no route {path}", "not_found_error"))
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self._error(HttpError(413, "request body too large"))
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return self._error(HttpError(400, "body is not JSON"))
            if not isinstance(body, dict):
                return self._error(HttpError(400, "body must be a JSON object"))
            self._run(lambda: routes_post[path](body))

    return Handler


def serve(
    base: str,
    catalog_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    load: list[str] = (),
    verbose: bool = False,
    **server_kwargs,
) -> None:
    """Run until SIGINT/SIGTERM. Prints one JSON line with the URL once it accepts connections (port 0: any free)."""
    catalog = Catalog(catalog_dir, create=False)
    server = AdapterServer(base, catalog, **server_kwargs)
    for item in load:
        name, sep, ref = item.partition("=")
        try:
            server.load(name if sep else ref, ref if sep else name)
        except HttpError as err:
            raise MintError(f"--load {item}: {err.message}") from None
    httpd = ThreadingHTTPServer((host, port), _handler(server, verbose))
    httpd.daemon_threads = True

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    url = f"http://{host}:{httpd.server_address[1]}"
    print(json.dumps({"event": "listening", "url": url, "base": server.base_path, "catalog": str(catalog.root)}))
    sys.stdout.flush()
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        catalog.close()
