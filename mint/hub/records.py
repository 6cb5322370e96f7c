"""Rollout records: the tokens, logprobs, rewards and routes of each step's responses, kept apart from revisions.

One shard per step, `records/<run>/step_NNNNNN.<rev12>.safetensors` in the catalog, linked by the id of the
revision the rollouts were sampled with (indexed in the catalog, so `Catalog.records(revision=...)` finds them).
safetensors, never pickle: a shard is a handful of packed tensors plus JSON metadata in the header.

Packed layout, for B groups (prompts) and N responses in total:

    prompt_tokens   [sum P_b]            int64    prompt_offsets    [B + 1]  int64
    tokens          [sum R_i]            int64    offsets           [N + 1]  int64
    logprobs        [sum R_i]            float32  (rollout logprobs, the convention of docs/decisions.md)
    rewards         [N]                  float32  group             [N]      int64 (index of the response's prompt)
    finished        [N]                  uint8    (1: ended on a stop token, 0: hit max_tokens)
    routes          [sum R_i, L, k]      uint8/int16, only for MoE and mode "full"
    prompt_routes   [sum (P_b - 1), L, k]         (same)

Header metadata: format, run, step, revision, created, and JSON lists of the prompts, answers and response texts.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from mint.errors import MintError
from mint.hub.catalog import Catalog, RecordShard
from mint.hub.revisions import READ_ONLY, fsync_dir

FORMAT = "mint.rollout_records/1"
MODES = ("full", "no_routes", "off")


@dataclass(frozen=True)
class RolloutRecord:
    """One response, unpacked from a shard."""

    run: str
    step: int
    revision: str  # the revision that sampled it
    prompt: str
    answer: str
    prompt_tokens_P: torch.Tensor  # [P] int64
    tokens_R: torch.Tensor  # [R] int64
    logprobs_R: torch.Tensor  # [R] float32
    reward: float
    finished: bool
    response: str
    routes_R_L_K: torch.Tensor | None  # [R, L, k]
    prompt_routes_P1_L_K: torch.Tensor | None  # [P-1, L, k]


@dataclass(frozen=True)
class StepRecords:
    """A whole shard: packed tensors plus header metadata."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]

    def __len__(self) -> int:
        return self.tensors["rewards"].shape[0]

    def responses(self) -> Iterator[RolloutRecord]:
        t, meta = self.tensors, self.meta
        prompts, answers = json.loads(meta["prompts"]), json.loads(meta["answers"])
        texts = json.loads(meta["responses"])
        p_off, off = t["prompt_offsets"].tolist(), t["offsets"].tolist()
        routes, p_routes = t.get("routes"), t.get("prompt_routes")
        p_route_off = [0]
        for b in range(len(p_off) - 1):
            p_route_off.append(p_route_off[-1] + max(p_off[b + 1] - p_off[b] - 1, 0))
        for i in range(len(self)):
            b = int(t["group"][i])
            yield RolloutRecord(
                run=meta["run"],
                step=int(meta["step"]),
                revision=meta["revision"],
                prompt=prompts[b],
                answer=answers[b],
                prompt_tokens_P=t["prompt_tokens"][p_off[b] : p_off[b + 1]],
                tokens_R=t["tokens"][off[i] : off[i + 1]],
                logprobs_R=t["logprobs"][off[i] : off[i + 1]],
                reward=float(t["rewards"][i]),
                finished=bool(t["finished"][i]),
                response=texts[i],
                routes_R_L_K=None if routes is None else routes[off[i] : off[i + 1]],
                prompt_routes_P1_L_K=None if p_routes is None else p_routes[p_route_off[b] : p_route_off[b + 1]],
            )


def _offsets(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        out[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return out


def pack(results: Sequence, run: str, step: int, revision: str, mode: str = "full") -> tuple[dict, dict]:
    """Pack GroupResults (mint.train.rollout_actor) into a shard's (tensors, metadata)."""
    if mode not in MODES:
        raise MintError(f"rollout records: mode {mode!r} is not one of {', '.join(MODES)}")
    prompts_P = [r.rollout.prompt_tokens_P for r in results]
    comps = [(b, c) for b, r in enumerate(results) for c in r.rollout.completions]
    tensors: dict[str, torch.Tensor] = {
        "prompt_tokens": torch.cat(prompts_P) if prompts_P else torch.zeros(0, dtype=torch.int64),
        "prompt_offsets": _offsets([len(p) for p in prompts_P]),
        "tokens": torch.cat([c.tokens_R for _, c in comps]) if comps else torch.zeros(0, dtype=torch.int64),
        "offsets": _offsets([len(c.tokens_R) for _, c in comps]),
        "logprobs": torch.cat([c.logprobs_R for _, c in comps]) if comps else torch.zeros(0),
        "rewards": torch.tensor([x for r in results for x in r.rewards_G], dtype=torch.float32),
        "group": torch.tensor([b for b, _ in comps], dtype=torch.int64),
        "finished": torch.tensor([c.finish_reason == "stop" for _, c in comps], dtype=torch.uint8),
    }
    if mode == "full" and comps and comps[0][1].routes_R_L_K is not None:
        tensors["routes"] = torch.cat([c.routes_R_L_K for _, c in comps])
        tensors["prompt_routes"] = torch.cat([r.rollout.prompt_routes_P1_L_K for r in results])
    meta = {
        "format": FORMAT,
        "run": run,
        "step": str(step),
        "revision": revision,
        "created": repr(time.time()),
        "prompts": json.dumps([r.example.prompt for r in results]),
        "answers": json.dumps([r.example.answer for r in results]),
        "responses": json.dumps([text for r in results for text in r.responses]),
    }
    return {k: v.contiguous() for k, v in tensors.items()}, meta


def write_step(
    catalog: Catalog, run: str, step: int, revision: str, results: Sequence, mode: str = "full"
) -> RecordShard | None:
    """Write one step's shard atomically (temp file, fsync, read-only, rename) and index it; None for mode "off"."""
    if mode == "off" or not results:
        return None
    tensors, meta = pack(results, run, step, revision, mode)
    data = st_save(tensors, metadata=meta)
    rel = Path("records") / run / f"step_{step:06d}.{revision[:12]}.safetensors"
    target = catalog.root / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, READ_ONLY)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    shard = RecordShard(
        run=run,
        step=step,
        revision=revision,
        path=str(rel),
        sha256=hashlib.sha256(data).hexdigest(),
        nbytes=len(data),
        responses=int(tensors["rewards"].shape[0]),
        created=float(meta["created"]),
    )
    catalog.add_records(shard)
    return shard


def read_step(catalog: Catalog, shard: RecordShard) -> StepRecords:
    """Load a shard, checking its sha256 against the index; a corrupt or partial file is refused in one line."""
    path = catalog.root / shard.path
    try:
        data = path.read_bytes()
    except OSError as err:
        raise MintError(f"{path}: rollout records unreadable ({err.strerror})") from None
    if hashlib.sha256(data).hexdigest() != shard.sha256:
        raise MintError(f"{path}: rollout records do not match their checksum; corrupt or partial, refusing to load")
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise MintError(f"{path}: not a {FORMAT} shard (format {meta.get('format')!r})")
    return StepRecords(tensors, meta)
