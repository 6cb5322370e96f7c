"""`mint serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) on the rollout engine's sampling, with
revisions hot-loaded over one frozen base and concurrent requests decoded in shared batches.

Endpoints
    GET  /v1/models, /v1/models/{id}   the base and every resident revision (`parent` = the base, as vLLM lists LoRA)
    POST /v1/completions               prompt: text, token ids, or a list of either; stream, n, logprobs=k, stop, seed
    POST /v1/chat/completions          messages (string or text-part content) through the base's chat template
    POST /v1/load_lora_adapter         {"lora_name", "lora_path", "load_inplace"}: vLLM's shape (load_inplace points
                                       an existing name at the new revision, as vLLM's RL weight swap does)
    POST /v1/unload_lora_adapter       {"lora_name"}
    GET  /health

The public API (names resolve lazily, so `mint --help` builds the parser without loading the server):
    serve(base, catalog_dir, ...)   run the server until SIGINT/SIGTERM
    add_parsers / run_command       the `mint serve` CLI

The parts, each its own module:
    _api      request/response models (pydantic); unsupported parameters; OpenAI error objects
    _model    the base, the resident revisions, where they may load from (catalog, --adapter-root)
    _sched    the bounded queue (429 when full) and the decode worker thread that batches per revision
    _decode   one decode batch: each request sampled as `RolloutEngine` samples it alone, with its own seed
    _render   decoded choices -> OpenAI objects and stream chunks
    _http     the FastAPI routes, body limits and timeouts
    _server   the process: logging, the socket, uvicorn, a clean exit on SIGTERM
    _cli      the `mint serve` flags

docs/mint.md ("Serving") describes the surface, what is refused, and the batching design. Routed experts (R3) come in
vLLM's encoding, with `--enable-return-routed-experts` on every whole response or per request with SGLang's
`return_routed_experts` field; docs/rollout.md gives the format and its source. The trainer's `rollout.backend = vllm`
uses this server as its stand-in for vLLM on CPU.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "serve": "mint.serve._server",
    "add_parsers": "mint.serve._cli",
    "run_command": "mint.serve._cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mint.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
