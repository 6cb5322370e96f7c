"""`rollout.backend = vllm`: engines that speak vLLM's OpenAI-compatible API (vLLM itself, or `mint serve`).

One group = one POST /v1/completions with the prompt as token ids and n = G:

    request   model (the policy adapter's lora_name), prompt [ids], n, max_tokens, temperature, top_p, seed,
              logprobs: 0 (the sampled token's logprob only), stop_token_ids, return_token_ids: true
    response  choices[i].token_ids, choices[i].logprobs.token_logprobs, choices[i].finish_reason, and with the server
              started with --enable-return-routed-experts, choices[i].routed_experts: base64 `.npy` [P+R-1, L, k],
              L = every decoder layer (a dense layer's rows are zeros)

Weight sync: POST /v1/load_lora_adapter {"lora_name", "lora_path": DIR, "load_inplace": true} swaps the adapter
behind one fixed name (vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); requests name it from then on. `load_on`
posts the same to one engine (one the run restarted, which lost it).

vLLM reports logprobs of the raw logits unless started with --logprobs-mode processed_logprobs, which gives
log softmax(logits / T), the learner's convention (with top_p = 1; docs/rollout.md). Formats: docs/rollout.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mint.rollout.backends.base import EngineError, HttpBackend, decode_npy, split_routes
from mint.rollout.engine import Completion, GroupRollout, SamplingParams

FINISH_REASONS = ("stop", "length")


class VllmBackend(HttpBackend):
    name = "vllm"
    health_paths = ("/health", "/v1/models")

    def __init__(self, urls, layout, timeout: float, lora_name: str = "mint-policy"):
        super().__init__(urls, layout, timeout)
        self.lora_name = lora_name
        self.model: str | None = None  # the adapter's name once loaded; before that, each engine's base

    def _model(self, url: str) -> str:
        if self.model is not None:
            return self.model
        models = self._request("GET", url, "/v1/models").json().get("data") or []
        if not models:
            raise EngineError(f"rollout engine {url}: /v1/models lists no model")
        return models[0]["id"]

    def load_adapter(self, revision: str, path: Path) -> None:
        for url in self.urls:
            self.load_on(url, revision, path)
        self.model = self.lora_name

    def load_on(self, url: str, revision: str, path: Path) -> None:
        body = {"lora_name": self.lora_name, "lora_path": str(path), "load_inplace": True}
        self._request("POST", url, "/v1/load_lora_adapter", body)  # vLLM answers plain text, mint serve JSON

    def _group(self, url: str, prompt: list[int], group_size: int, params: SamplingParams, seed: int) -> GroupRollout:
        body = dict(
            model=self._model(url),
            prompt=prompt,
            n=group_size,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=seed,
            logprobs=0,
            stop_token_ids=list(params.stop_token_ids),
            return_token_ids=True,
        )
        out = self._post_json(url, "/v1/completions", body)
        choices = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != group_size:
            raise EngineError(f"rollout engine {url}: asked for n={group_size} completions, got {len(choices)}")
        return self._assemble(url, prompt, choices)

    def _completion(self, url: str, choice: dict, num_prompt: int) -> tuple[Completion, torch.Tensor | None]:
        ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        finish = choice.get("finish_reason")
        if not ids or logprobs is None or len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
            raise EngineError(
                f"rollout engine {url}: a choice without token_ids and one logprob per token "
                "(vLLM needs return_token_ids and logprobs; is it older than v0.10.2?)"
            )
        if finish not in FINISH_REASONS:
            raise EngineError(f"rollout engine {url}: finish_reason {finish!r} (expected stop or length)")
        encoded = choice.get("routed_experts")
        rows = decode_npy(encoded) if isinstance(encoded, str) else None
        prompt_routes, routes = split_routes(rows, num_prompt, len(ids), self.layout)
        completion = Completion(
            tokens_R=torch.tensor(ids, dtype=torch.int64),
            logprobs_R=torch.tensor(logprobs, dtype=torch.float32),
            routes_R_L_K=routes,
            finish_reason=finish,
        )
        return completion, prompt_routes
