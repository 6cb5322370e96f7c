"""Rollout backends behind one interface (`RolloutBackend.generate` -> `GroupRollout`s):

    builtin   the built-in engine in the rollout actor's process (`BuiltinBackend`)
    vllm      servers speaking vLLM's OpenAI-compatible API, vLLM or `mint serve` (`VllmBackend`)
    sglang    SGLang servers through their native /generate API (`SglangBackend`)

docs/rollout.md describes the formats, where they come from, and the weight-sync path.
"""

from mint.rollout.backends.base import EngineError, HttpBackend, RolloutBackend, split_routes
from mint.rollout.backends.openai_compat import VllmBackend
from mint.rollout.backends.sglang import SglangBackend

HTTP_BACKENDS = {"vllm": VllmBackend, "sglang": SglangBackend}


def http_backend(name: str, urls, layout, timeout: float, lora_name: str = "mint-policy") -> HttpBackend:
    """The HTTP backend `name` over `urls`, health-checked (one line naming the first engine that is down)."""
    if name not in HTTP_BACKENDS:
        raise EngineError(f"rollout.backend: {name!r} is not an HTTP backend (one of {', '.join(HTTP_BACKENDS)})")
    backend = HTTP_BACKENDS[name](urls, layout, timeout, lora_name)
    try:
        backend.check_health()
    except BaseException:
        backend.close()
        raise
    return backend


__all__ = [
    "HTTP_BACKENDS",
    "EngineError",
    "HttpBackend",
    "RolloutBackend",
    "SglangBackend",
    "VllmBackend",
    "http_backend",
    "split_routes",
]
