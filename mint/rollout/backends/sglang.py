"""`rollout.backend = sglang`: SGLang servers through their native /generate API.

One group = one POST /generate with G copies of the prompt (a batch: the radix cache holds the prefix once):

    request   input_ids [[ids] x G], sampling_params [{temperature, top_p, max_new_tokens, stop_token_ids,
              sampling_seed} x G] (sample j: sampling_seed = group_seed(the group's seed, j)), return_logprob: true,
              return_routed_experts: true, lora_path (the loaded adapter's name)
    response  a list of G objects: output_ids, meta_info.output_token_logprobs [[logprob, id, text], ...],
              meta_info.finish_reason {"type": "stop" | "length" | "abort", ...}, and with the server started with
              --enable-return-routed-experts, meta_info.routed_experts: base64 of int32 [P+R-1, L, k] (shape not sent;
              L = every decoder layer, dense ones included)

Weight sync: SGLang names adapters and has no in-place swap, so each revision loads under its own name
(POST /load_lora_adapter {"lora_name", "lora_path"}), later requests name it, and the previous one is unloaded
(POST /unload_lora_adapter {"lora_name"}); `load_on` loads the current one again on one engine (one the run
restarted). SGLang's logprobs are log softmax(logits / T) before top-p, the learner's convention, unless
SGLANG_RETURN_ORIGINAL_LOGPROB is set. Formats and their sources: docs/rollout.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mint.rollout.backends.base import EngineError, HttpBackend, decode_int32, split_routes
from mint.rollout.engine import Completion, GroupRollout, SamplingParams, group_seed

FINISH_TYPES = ("stop", "length")


class SglangBackend(HttpBackend):
    name = "sglang"
    health_paths = ("/health",)

    def __init__(self, urls, layout, timeout: float, lora_name: str = "mint-policy"):
        super().__init__(urls, layout, timeout)
        self.prefix = lora_name
        self.adapter: str | None = None  # the name requests use; None samples the base

    def _name(self, revision: str) -> str:
        return f"{self.prefix}-{revision[:16]}"

    def load_adapter(self, revision: str, path: Path) -> None:
        name = self._name(revision)
        if name == self.adapter:
            return
        for url in self.urls:
            self._request("POST", url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        old, self.adapter = self.adapter, name
        if old is not None:  # after the switch: no request in flight names it any more
            for url in self.urls:
                self._request("POST", url, "/unload_lora_adapter", {"lora_name": old})

    def load_on(self, url: str, revision: str, path: Path) -> None:
        name = self._name(revision)
        if name != self.adapter:  # only the revision requests name now: loading another would not be used
            raise EngineError(f"rollout engine {url}: asked to load {name} there, but requests name {self.adapter}")
        self._request("POST", url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def _group(self, url: str, prompt: list[int], group_size: int, params: SamplingParams, seed: int) -> GroupRollout:
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_new_tokens": params.max_tokens,
            "stop_token_ids": list(params.stop_token_ids),
        }
        body = {
            "input_ids": [prompt] * group_size,
            # One dict per sample: SGLang copies a single dict to every input, and with one sampling_seed for G
            # copies of one prompt its deterministic sampler draws the same response G times (advantage 0). Sample
            # j takes group_seed(seed, j), not seed + j: shard seeds are consecutive (step_seed * 1000 + shard), so
            # seed + j would give sample 1 of one shard's first group the seed of the next shard's.
            "sampling_params": [{**sampling, "sampling_seed": group_seed(seed, j)} for j in range(group_size)],
            "return_logprob": True,
            "return_routed_experts": self.layout is not None,
        }
        if self.adapter is not None:
            body["lora_path"] = self.adapter  # one name for the whole batch
        out = self._post_json(url, "/generate", body)
        if not isinstance(out, list) or len(out) != group_size:
            got = len(out) if isinstance(out, list) else type(out).__name__
            raise EngineError(f"rollout engine {url}: /generate with {group_size} prompts answered {got} results")
        return self._assemble(url, prompt, out)

    def _completion(self, url: str, item: dict, num_prompt: int) -> tuple[Completion, torch.Tensor | None]:
        meta = item.get("meta_info") or {}
        ids = item.get("output_ids")
        logprobs = meta.get("output_token_logprobs")
        if not ids or logprobs is None or len(logprobs) != len(ids):
            raise EngineError(f"rollout engine {url}: a result without output_ids and one logprob per token")
        if [entry[1] for entry in logprobs] != ids:
            raise EngineError(f"rollout engine {url}: output_token_logprobs do not follow output_ids")
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish not in FINISH_TYPES:
            raise EngineError(f"rollout engine {url}: finish_reason {meta.get('finish_reason')!r}")
        encoded = meta.get("routed_experts")
        num_rows = num_prompt + len(ids) - 1
        rows = decode_int32(encoded, num_rows) if isinstance(encoded, str) else None
        prompt_routes, routes = split_routes(rows, num_prompt, len(ids), self.layout)
        completion = Completion(
            tokens_R=torch.tensor(ids, dtype=torch.int64),
            logprobs_R=torch.tensor([float(entry[0]) for entry in logprobs], dtype=torch.float32),
            routes_R_L_K=routes,
            finish_reason=finish,
        )
        return completion, prompt_routes
