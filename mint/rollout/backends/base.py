"""The rollout backend interface, and what the HTTP backends share: engines, health checks, requests, routes.

A backend samples one group of G responses per prompt and returns the built-in engine's `GroupRollout`s, so the
rest of the trainer does not know which engine ran:

    tokens_R        the sampled ids; a response that ended on eos or a stop id keeps that token last
    logprobs_R      log softmax(logits / T) at each token, T = the recipe's temperature (the learner's convention)
    finish_reason   "stop" | "length"
    routes_R_L_K    row j = the routing of the forward that produced token j; prompt_routes_P1_L_K covers prompt
                    positions 0..P-2 (R3, `mint.rollout.engine`'s docstring)

An engine that returns no routes (or routes that do not line up with the tokens) gives None: the learner's trust mask
then counts those tokens as `route_missing` and R3 leaves them out, as for any missing record. With R3 on, preflight
asks each listed engine for one routed sample and refuses one that sends none, and a run whose tokens are nearly all
masked stops (docs/mismatch.md).

Engines (`engines.urls`) are servers that already run. One group's G samples go to one engine in one request, so
they share its prefix cache; groups are spread round-robin over the engines and sent concurrently, so each engine
batches them (continuous batching) as it would any burst of requests.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import torch

from longstraw.routing import ExpertLayout
from mint.errors import MintError
from mint.rollout.engine import GroupRollout, SamplingParams, group_seed

# Groups in flight at once per call; the engines queue the rest themselves.
MAX_CONCURRENT_GROUPS = 64


class EngineError(MintError):
    """A rollout engine server is down, refused a request, or answered outside its protocol."""


class EngineUnreachable(EngineError):
    """No connection to a rollout engine server (refused, reset): often a server that is dying."""


class RolloutBackend:
    """Where a step's groups are sampled. Subclasses: `BuiltinBackend`, `VllmBackend`, `SglangBackend`."""

    name = "?"

    def generate(
        self, prompts: list[Sequence[int]], group_size: int, params: SamplingParams, seed: int
    ) -> list[GroupRollout]:
        """One group of `group_size` completions per prompt. Group i is seeded with `group_seed(seed, i)`, as the
        built-in engine seeds it (where the engine takes a seed)."""
        raise NotImplementedError

    def load_adapter(self, revision: str, path: Path) -> None:
        """Make revision `revision` (a PEFT adapter directory at `path`) the one every later request samples with."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# How long an idle pooled connection may be reused. vLLM's and SGLang's HTTP servers (uvicorn) close a connection
# idle for 5 s, httpx's own default; a request sent on a connection at the moment its server closes it fails with
# "Server disconnected without sending a response", and a run's steps are often about that far apart (a learner step
# plus the adapter load). Dropping idle connections well before any server does makes every reuse safe.
KEEPALIVE_S = 2.0


class HttpBackend(RolloutBackend):
    """Engines behind HTTP: a client with timeouts, a health check, and groups spread over the engines."""

    health_paths: tuple[str, ...] = ("/health",)

    def __init__(self, urls: Sequence[str], layout: ExpertLayout | None, timeout: float):
        if not urls:
            raise EngineError(f"rollout.backend = {self.name}: no engine; list the servers in engines.urls")
        self.urls = [u.rstrip("/") for u in urls]
        self.layout = layout
        self.client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )
        self._next = 0  # round-robin position: consecutive calls start on the next engine

    # ---- requests -----------------------------------------------------------------------------------------------

    def _request(self, method: str, url: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            response = self.client.request(method, url + path, json=body)
        except httpx.TimeoutException:
            raise EngineError(f"rollout engine {url}: {method} {path} timed out (engines.request_timeout)") from None
        except httpx.HTTPError as err:
            down = f"rollout engine {url} is down ({_one_line(err)}); start it or fix engines.urls"
            raise EngineUnreachable(down) from None
        if response.status_code != 200:
            raise EngineError(
                f"rollout engine {url}: {method} {path} answered {response.status_code}: {_one_line(response.text)}"
            )
        return response

    def _post_json(self, url: str, path: str, body: dict):
        response = self._request("POST", url, path, body)
        try:
            return response.json()
        except ValueError:
            raise EngineError(f"rollout engine {url}: {path} answered non-JSON: {_one_line(response.text)}") from None

    def load_on(self, url: str, revision: str, path: Path) -> None:
        """Load revision `revision` (the adapter directory at `path`) on engine `url` only, under the name requests
        use for it now: an engine restarted by the run lost its adapters, the others still hold them."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Every engine answers its health path with 200, or one line names the first that does not."""
        for url in self.urls:
            last = None
            for path in self.health_paths:
                try:
                    self._request("GET", url, path)
                    break
                except EngineError as err:
                    last = err
            else:
                raise last

    # ---- groups -------------------------------------------------------------------------------------------------

    def _assemble(self, url: str, prompt: Sequence[int], items: list) -> GroupRollout:
        """A group from the engine's G answers (`_completion` reads one); the prompt routes come from the first
        answer that carries them."""
        completions, prompt_routes = [], None
        for item in items:
            completion, routes_P1 = self._completion(url, item, len(prompt))
            completions.append(completion)
            prompt_routes = routes_P1 if prompt_routes is None else prompt_routes
        return GroupRollout(torch.tensor(prompt, dtype=torch.int64), prompt_routes, completions)

    def generate(
        self, prompts: list[Sequence[int]], group_size: int, params: SamplingParams, seed: int
    ) -> list[GroupRollout]:
        for prompt in prompts:
            if len(prompt) == 0:
                raise MintError("rollout: empty prompt; a completion needs at least one prompt token to condition on")
        start, n = self._next, len(self.urls)
        self._next = (self._next + len(prompts)) % n
        urls = [self.urls[(start + i) % n] for i in range(len(prompts))]
        jobs = [(urls[i], list(p), group_size, params, group_seed(seed, i)) for i, p in enumerate(prompts)]
        if len(jobs) == 1:
            return [self._group(*jobs[0])]
        with ThreadPoolExecutor(max_workers=min(len(jobs), MAX_CONCURRENT_GROUPS)) as pool:
            return list(pool.map(lambda job: self._group(*job), jobs))

    def _group(self, url: str, prompt: list[int], group_size: int, params: SamplingParams, seed: int) -> GroupRollout:
        raise NotImplementedError

    def close(self) -> None:
        self.client.close()


# ---- routes -------------------------------------------------------------------------------------------------------


def decode_npy(text: str) -> np.ndarray:
    """vLLM's `routed_experts`: base64 of `.npy` bytes (never unpickled)."""
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def decode_int32(text: str, num_rows: int) -> np.ndarray | None:
    """SGLang's `routed_experts`: base64 of raw int32 bytes of a [num_rows, L, k] array, L = all decoder layers (its
    shape is not sent; `split_routes` reshapes the [num_rows, 1, L * k] this returns). None when the size does not
    split into num_rows rows."""
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    if num_rows <= 0 or flat.size % num_rows:
        return None
    return flat.reshape(num_rows, 1, -1)


def split_routes(
    rows_S_L_K: np.ndarray | None, num_prompt: int, num_tokens: int, layout: ExpertLayout | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An engine's whole-sequence routes [P+R-1, L, k] -> (prompt routes [P-1, L_moe, k], response routes
    [R, L_moe, k]).

    Row i of an engine's array is the routing of the forward over input position i (vLLM and SGLang alike), which is
    the R3 convention of `mint.rollout.engine`: rows 0..P-2 are the prompt's, row P-1+j produced token j. L is either
    every decoder layer (vLLM's and SGLang's form, `layout.decoder_layers`: a dense layer's row holds zeros, so only
    the MoE layers' rows `layout.moe_layer_ids` are kept) or the MoE layers only (`layout.num_layers`); SGLang's flat
    [S, 1, L * k] rows are reshaped first. Anything that does not line up with the tokens (or a dense base) gives
    (None, None): R3 counts the tokens as missing; a layer count that is neither is passed on for the learner to
    count (route_layers). Ids are stored in the layout's route dtype when they fit; out-of-range ids are kept as
    int64 for the learner to count (route_status).
    """
    if rows_S_L_K is None or layout is None:
        return None, None
    if rows_S_L_K.ndim != 3 or rows_S_L_K.shape[0] != num_prompt + num_tokens - 1:
        return None, None
    num_rows, decoder_layers, k = rows_S_L_K.shape[0], layout.decoder_layers, layout.top_k
    if rows_S_L_K.shape[1] == 1 and rows_S_L_K.shape[2] in (decoder_layers * k, layout.num_layers * k):
        rows_S_L_K = rows_S_L_K.reshape(num_rows, rows_S_L_K.shape[2] // k, k)  # SGLang's flat rows
    if rows_S_L_K.shape[1] == decoder_layers != layout.num_layers:
        rows_S_L_K = rows_S_L_K[:, list(layout.moe_layer_ids)]  # one row per decoder layer: keep the MoE layers'
    ids = torch.from_numpy(rows_S_L_K.astype(np.int64))
    if ids.numel() and int(ids.min()) >= 0 and int(ids.max()) < layout.num_experts:
        ids = ids.to(layout.route_dtype)
    return ids[: num_prompt - 1].clone(), ids[num_prompt - 1 :].clone()
