"""DSA's sparse latent attention against the dense latent attention, forward + backward at real per-layer dims (CPU).

Usage:
    python bench/sparse_latent.py                              # DeepSeek-V3.2 dims, R=32, P in {4096, 16384}
    python bench/sparse_latent.py --shape glm5                 # GLM-5: 64 heads, the same latent widths and K
    python bench/sparse_latent.py --quick                      # tiny dims (a smoke run, seconds)

Both ops take one sequence in MLA's absorbed form (H query heads on one page head): q [H, R, D_k], prefix pages
[P, D_k], own pages [R, D_k], D_k = kv_lora_rank + qk_rope_head_dim = 576, D_v = kv_lora_rank = 512; the heads and
K = index_topk come from mint.models.shapes. Random fp32 tensors (bf16 matmuls are slow on CPU and would time the
conversion, not the op), one thread by default (--threads; the dev box has 2 cores shared with other jobs).
    dense   latent_prefix_attention (its CPU path, the blocked torch reference): every head over all P prefix pages
            and, causally, the R own pages
    sparse  sparse_latent_attention: each token over the K positions of a random causal selection (the own page of
            the token itself always among them; slots past the P + r + 1 visible keys are empty, -1)
Each step is forward + backward in exact mode: the prefix gradient is added into one fp32 [P, D_k] dpage_acc buffer,
q and the own pages get theirs through autograd. Per P it reports:
    *_s             median seconds of a step (dense and sparse interleaved, one warm-up each)
    sparse_over_dense_time  the ratio of the medians; *_paired the median of the per-repeat ratios (each repeat runs
                    the two ops back to back, so a load spike from another job hits both of a pair)
    flop_ratio      K / (P + R): the keys per query the sparse op scores over those the dense op scores (it scores the
                    whole own block and masks); the time ratio a compute-bound sparse op would reach
    measured_over_flop      how far the measured ratio is from that; *_gflops the rate each op achieved, counting
                    2 H R N (4 D_k + 3 D_v) FLOP per step (N keys per query: forward q.k and p.v, backward q.k again,
                    dO.v, dq, the key and the value part of dPage)
    *_saved_bytes   bytes saved for backward (saved-tensor hooks over unique storages; the prefix pages and dpage_acc
                    are excluded: live anyway, and both ops hold the pages by reference, not as saved tensors)
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from longstraw.memory import GraphMeter
from mint.models.shapes import shape
from mint_kernels import latent_prefix_attention, sparse_latent_attention


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="deepseek_v32", help="a DSA shape of mint.models.shapes")
    parser.add_argument("--response-len", type=int, default=32, help="R: response tokens (query tokens)")
    parser.add_argument("--prefix-lens", default="4096,16384", help="comma-separated prefix lengths P")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per op and P (after one warm-up); median")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="tiny dims (H=4, D_k=24, D_v=16, K=8, R=4, P in {16, 64})")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def dims(args: argparse.Namespace) -> dict:
    """H, D_k, D_v, K, scale, R and the prefix lengths of the run."""
    if args.quick:
        return {"H": 4, "Dk": 24, "Dv": 16, "K": 8, "scale": 24**-0.5, "R": 4, "P": [16, 64]}
    s = shape(args.shape)
    if not s.index_topk:
        raise SystemExit(f"{args.shape} has no lightning indexer (index_topk); pick a DSA shape")
    Dk = s.kv_lora_rank + s.qk_rope_head_dim
    return {
        "H": s.heads,
        "Dk": Dk,
        "Dv": s.kv_lora_rank,
        "K": s.index_topk,
        "scale": (s.qk_nope_head_dim + s.qk_rope_head_dim) ** -0.5,  # the module's softmax scale, without YaRN mscale
        "R": args.response_len,
        "P": [int(p) for p in args.prefix_lens.split(",")],
    }


def random_selection(P: int, R: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """index [R, K]: token r's K positions in [pages; own], drawn at random among its P + r + 1 causal keys, its own
    page always included (the indexer's causal top-k keeps it in practice); -1 where fewer than K are visible."""
    score_R_N = torch.rand(R, P + R, generator=gen)
    pos_N = torch.arange(P + R)
    visible_R_N = pos_N[None, :] <= P + torch.arange(R)[:, None]
    score_R_N = score_R_N.masked_fill(~visible_R_N, -1.0)
    score_R_N[torch.arange(R), P + torch.arange(R)] = 2.0  # the token's own page
    top, index_R_K = score_R_N.topk(min(K, P + R), dim=-1)
    index_R_K = index_R_K.masked_fill(top < 0, -1)
    if index_R_K.shape[1] < K:
        index_R_K = torch.cat([index_R_K, index_R_K.new_full((R, K - index_R_K.shape[1]), -1)], dim=1)
    return index_R_K


def make_case(d: dict, P: int, gen: torch.Generator) -> dict:
    H, R, Dk, Dv = d["H"], d["R"], d["Dk"], d["Dv"]
    return {
        "q": torch.randn(H, R, Dk, generator=gen).requires_grad_(),
        "pages": torch.randn(P, Dk, generator=gen),
        "own": torch.randn(R, Dk, generator=gen).requires_grad_(),
        "index": random_selection(P, R, d["K"], gen),
        "dout": torch.randn(H, R, Dv, generator=gen),
        "acc": torch.zeros(P, Dk),
    }


def forward(op: str, c: dict, d: dict) -> torch.Tensor:
    if op == "dense":
        return latent_prefix_attention(c["q"], c["pages"], c["own"], d["Dv"], d["scale"], dpage_acc=c["acc"])
    return sparse_latent_attention(c["q"], c["pages"], c["own"], c["index"], d["Dv"], d["scale"], dpage_acc=c["acc"])


def step(op: str, c: dict, d: dict) -> float:
    """Seconds of one forward + backward; the gradients are dropped afterwards (dpage_acc keeps accumulating)."""
    start = time.perf_counter()
    forward(op, c, d).backward(c["dout"])
    seconds = time.perf_counter() - start
    c["q"].grad = c["own"].grad = None
    return seconds


def saved_bytes(op: str, c: dict, d: dict) -> int:
    exclude = {c["pages"].untyped_storage().data_ptr(), c["acc"].untyped_storage().data_ptr()}
    with GraphMeter(exclude) as meter:
        out = forward(op, c, d)
    del out
    return meter.nbytes


def run_prefix(d: dict, P: int, reps: int, gen: torch.Generator) -> dict:
    c = make_case(d, P, gen)
    H, R, Dk, Dv, K = d["H"], d["R"], d["Dk"], d["Dv"], d["K"]
    saved = {op: saved_bytes(op, c, d) for op in ("dense", "sparse")}
    seconds = {"dense": [], "sparse": []}
    for op in ("dense", "sparse"):  # warm-up
        step(op, c, d)
    for _ in range(reps):  # interleaved: the box is shared, so both ops see the same noise
        for op in ("dense", "sparse"):
            seconds[op].append(step(op, c, d))
    median = {op: statistics.median(v) for op, v in seconds.items()}
    flop = {op: 2 * H * R * n * (4 * Dk + 3 * Dv) for op, n in (("dense", P + R), ("sparse", K))}
    ratio, flop_ratio = median["sparse"] / median["dense"], K / (P + R)
    paired = [sparse / dense for sparse, dense in zip(seconds["sparse"], seconds["dense"], strict=True)]
    return {
        "P": P,
        "dense_s": round(median["dense"], 4),
        "sparse_s": round(median["sparse"], 4),
        "dense_s_all": [round(t, 4) for t in seconds["dense"]],
        "sparse_s_all": [round(t, 4) for t in seconds["sparse"]],
        "sparse_over_dense_time": round(ratio, 4),
        "sparse_over_dense_time_paired": round(statistics.median(paired), 4),
        "flop_ratio": round(flop_ratio, 4),
        "measured_over_flop": round(ratio / flop_ratio, 3),
        "dense_gflops": round(flop["dense"] / median["dense"] / 1e9, 2),
        "sparse_gflops": round(flop["sparse"] / median["sparse"] / 1e9, 2),
        "dense_saved_bytes": saved["dense"],
        "sparse_saved_bytes": saved["sparse"],
        "valid_slots_per_token": round(float((c["index"] >= 0).sum(-1).float().mean()), 1),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    d = dims(args)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    rows = []
    for P in d["P"]:
        rows.append(run_prefix(d, P, args.reps, gen))
        print(f"P={P}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    H, R, Dk, Dv, K = d["H"], d["R"], d["Dk"], d["Dv"], d["K"]
    first, last = rows[0], rows[-1]
    result = {
        "bench": "sparse_latent",
        "shape": "quick" if args.quick else args.shape,
        "dtype": "float32",
        "threads": args.threads,
        "H": H,
        "R": R,
        "D_k": Dk,
        "D_v": Dv,
        "K": K,
        "reps": args.reps,
        "by_prefix": rows,
        # The flatness claims: saved bytes at the largest P over those at the smallest (1.0 = do not grow with P).
        "sparse_saved_last_over_first_P": round(last["sparse_saved_bytes"] / first["sparse_saved_bytes"], 4),
        "dense_saved_last_over_first_P": round(last["dense_saved_bytes"] / first["dense_saved_bytes"], 4),
        # O(R) by construction: q, own, out, lse (fp32) for both; the sparse op also keeps its int64 index [R, K].
        "expected_dense_saved_bytes": 4 * (H * R * Dk + R * Dk + H * R * Dv + H * R),
        "expected_sparse_saved_bytes": 4 * (H * R * Dk + R * Dk + H * R * Dv + H * R) + 8 * R * K,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
