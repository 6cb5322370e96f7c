"""GPU benchmark of the LongStraw kernels, all in bf16. One short call on an H200 (< 5 minutes).

prefix attention, forward + backward, D=128, H_q=32, H_kv=4, P in {8k, 64k, 512k}, R in {512, 4096}:
    ours        prefix_attention in detached mode (no prefix dK/dV), the LongStraw replay default
    ours_exact  prefix_attention adding prefix dK/dV into fp32 buffers (LongStraw exact mode)
    sdpa        torch SDPA on concatenated K/V with a bottom-right causal mask (the concat is timed: it is a
                per-layer, per-replay copy), which computes dK/dV for the whole prefix
    flash_attn  flash_attn_func on concatenated K/V, causal (bottom-right), when flash-attn imports
fused head, forward + backward, H=4096, V=151,936, T in {4k, 32k}, frozen head (dHidden only):
    ours        fused_logprob (log-prob and entropy)
    torch       logits = hidden @ W.T; log_softmax in fp32; gather (+ entropy from the same log-probs)
expert LoRA, forward + backward of one MoE projection on N = 4096 tokens x top-8 = 32768 routed rows,
Qwen3-30B-A3B-like: E=128, r=32, gate_up (H=2048 -> O=1536) and down (I=768 -> O=2048), grads to x, lora_A, lora_B:
    ours        base grouped matmul (frozen W) + expert_lora (factored LoRA, Triton)
    reference   base grouped matmul + expert_lora_reference (the CPU path's per-segment torch loop)
    peft        PEFT target_parameters: W + s einsum(lora_B, lora_A) materialized ([E, O, H]), then grouped matmul
    lora_only   expert_lora alone (the kernels' own time)
    The grouped matmul is a per-expert loop of torch matmuls, the same in the three full variants.
latent prefix attention (MLA absorbed form), forward + backward, DeepSeek-V3 widths D_k=576, D_v=512, H=128 heads on
one page head, (P, R) in {(8k, 64), (64k, 64), (64k, 512)}:
    ours            latent_prefix_attention in detached mode
    ours_exact      latent_prefix_attention adding the pages' gradient into one fp32 [P, 576] buffer
    via_prefix      prefix_attention with the pages as both K and V (D = 576 output, rope columns dropped)
    via_prefix_exact  the same with its two fp32 [P, 576] dK/dV buffers

Each case reports the median time of a few runs (CUDA events) and the peak memory above what its inputs hold.
Targets: prefix attention >= 1.5x faster than SDPA when P/R >= 16; fused head >= 10x less peak memory
than materialized logits at T=32k, and no slower.

    python bench/kernels_gpu.py            # all cases
    python bench/kernels_gpu.py --quick    # smallest case of each kernel (a smoke run)

Without CUDA it prints one line saying so and a JSON object with "skipped": true. The last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import sys
import time

import torch

from mint_kernels import (
    expert_lora,
    expert_lora_reference,
    fused_logprob,
    latent_prefix_attention,
    prefix_attention,
)

BUDGET_S = 270.0  # stop starting new cases after this, so the whole call stays under 5 minutes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the smallest case of each kernel")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per case (after one warm-up); median kept")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def measure(step, reps: int) -> dict:
    """Median ms of `step()` over reps after one warm-up (which also compiles), and peak bytes above the inputs.

    Steps drop their gradients at the end, so the peak counts the gradients they allocate but not a previous run's.
    """
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {
        "ms": round(statistics.median(times), 3),
        "peak_extra_mb": round((torch.cuda.max_memory_allocated() - base) / 2**20, 1),
    }


def guarded(step, reps: int) -> dict:
    try:
        return measure(step, reps)
    except torch.cuda.OutOfMemoryError:
        return {"error": "oom"}
    except Exception as exc:  # a baseline that cannot run here (missing kernel, unsupported mask) is a result too
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    finally:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------------
# Prefix attention
# --------------------------------------------------------------------------------------------------------------------


def sdpa_step(q, kp, vp, kr, vr, do, scale, gqa: bool):
    from torch.nn.attention.bias import causal_lower_right

    R, P = q.shape[2], kp.shape[2]
    mask = causal_lower_right(R, P + R)
    hq, hkv = q.shape[1], kp.shape[1]

    def step():
        k = torch.cat([kp, kr], dim=2)
        v = torch.cat([vp, vr], dim=2)
        if gqa:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:  # SDPA without GQA support on this path: materialize the repeated K/V (what older stacks do)
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out.backward(do)
        for t in (q, kr, vr):
            t.grad = None

    return step


def flash_step(q, kp, vp, kr, vr, do, scale):
    from flash_attn import flash_attn_func

    # flash-attn wants [B, N, H, D]; the layout change is setup, not timed.
    qf = q.detach().transpose(1, 2).contiguous().requires_grad_()
    kpf, vpf = (t.transpose(1, 2).contiguous() for t in (kp, vp))
    krf, vrf = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (kr, vr))
    dof = do.transpose(1, 2).contiguous()

    def step():
        k = torch.cat([kpf, krf], dim=1)
        v = torch.cat([vpf, vrf], dim=1)
        out = flash_attn_func(qf, k, v, softmax_scale=scale, causal=True)  # causal is bottom-right when R < P + R
        out.backward(dof)
        for t in (qf, krf, vrf):
            t.grad = None

    return step


def ours_step(q, kp, vp, kr, vr, do, scale, exact: bool):
    dk = torch.zeros(kp.shape, device=kp.device, dtype=torch.float32) if exact else None
    dv = torch.zeros(kp.shape, device=kp.device, dtype=torch.float32) if exact else None

    def step():
        out = prefix_attention(q, kp, vp, kr, vr, scale, dk_prefix_acc=dk, dv_prefix_acc=dv)
        out.backward(do)
        for t in (q, kr, vr):
            t.grad = None

    return step


def bench_prefix_attention(P: int, R: int, reps: int, seed: int) -> dict:
    Hq, Hkv, D = 32, 4, 128
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    q = rnd(1, Hq, R, D).requires_grad_()
    kp, vp = rnd(1, Hkv, P, D), rnd(1, Hkv, P, D)
    kr, vr = rnd(1, Hkv, R, D).requires_grad_(), rnd(1, Hkv, R, D).requires_grad_()
    do = rnd(1, Hq, R, D)
    scale = 1.0 / math.sqrt(D)
    row = {"P": P, "R": R, "D": D, "H_q": Hq, "H_kv": Hkv}

    # Agreement with SDPA on the forward (bf16 outputs; a sanity check, the tests hold the real tolerances).
    try:
        with torch.no_grad():
            from torch.nn.attention.bias import causal_lower_right

            ours = prefix_attention(q, kp, vp, kr, vr, scale)
            k, v = torch.cat([kp, kr], 2), torch.cat([vp, vr], 2)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(R, P + R), scale=scale, enable_gqa=True
            )
            row["max_abs_diff_vs_sdpa"] = float((ours.float() - ref.float()).abs().max())
            del ours, ref, k, v
    except Exception as exc:
        row["max_abs_diff_vs_sdpa"] = f"{type(exc).__name__}"
    torch.cuda.empty_cache()

    row["ours"] = guarded(ours_step(q, kp, vp, kr, vr, do, scale, exact=False), reps)
    row["ours_exact"] = guarded(ours_step(q, kp, vp, kr, vr, do, scale, exact=True), reps)
    row["sdpa"] = guarded(sdpa_step(q, kp, vp, kr, vr, do, scale, gqa=True), reps)
    if "error" in row["sdpa"]:
        row["sdpa_gqa_error"] = row["sdpa"]["error"]
        row["sdpa"] = guarded(sdpa_step(q, kp, vp, kr, vr, do, scale, gqa=False), reps)
        row["sdpa"]["kv"] = "repeat_interleave"
    try:
        import flash_attn  # noqa: F401

        row["flash_attn"] = guarded(flash_step(q, kp, vp, kr, vr, do, scale), reps)
    except ImportError:
        row["flash_attn"] = {"error": "not installed"}
    if "ms" in row["ours"] and "ms" in row["sdpa"]:
        row["speedup_vs_sdpa"] = round(row["sdpa"]["ms"] / row["ours"]["ms"], 3)
    if "ms" in row["ours"] and "ms" in row["flash_attn"]:
        row["speedup_vs_flash_attn"] = round(row["flash_attn"]["ms"] / row["ours"]["ms"], 3)
    return row


# --------------------------------------------------------------------------------------------------------------------
# Latent prefix attention
# --------------------------------------------------------------------------------------------------------------------


def latent_step(q, pages, own, do, scale, *, exact: bool, via_prefix: bool):
    """One forward + backward of MLA's absorbed attention, by the latent kernel or through prefix_attention."""
    Dv = do.shape[-1]
    n_acc = (2 if via_prefix else 1) if exact else 0
    accs = [torch.zeros(pages.shape, device=pages.device, dtype=torch.float32) for _ in range(n_acc)]

    def step():
        if via_prefix:
            kv, page = pages[None], own[:, None]
            acc = dict(dk_prefix_acc=accs[0][None], dv_prefix_acc=accs[1][None]) if exact else {}
            out = prefix_attention(q, kv, kv, page, page, scale, **acc)[..., :Dv]
        else:
            out = latent_prefix_attention(q, pages, own, Dv, scale, dpage_acc=accs[0] if exact else None)
        out.backward(do)
        q.grad = own.grad = None

    return step


def bench_latent_attention(P: int, R: int, reps: int, seed: int) -> dict:
    H, Dk, Dv = 128, 576, 512
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    q, pages, own = rnd(1, H, R, Dk).requires_grad_(), rnd(P, Dk), rnd(1, R, Dk).requires_grad_()
    do = rnd(1, H, R, Dv)
    scale = 1.0 / math.sqrt(192)  # DeepSeek-V3's qk_head_dim (nope 128 + rope 64), without the YaRN mscale
    row = {"P": P, "R": R, "H": H, "D_k": Dk, "D_v": Dv}
    try:
        with torch.no_grad():
            ours = latent_prefix_attention(q, pages, own, Dv, scale)
            ref = prefix_attention(q, pages[None], pages[None], own[:, None], own[:, None], scale)[..., :Dv]
            row["max_abs_diff_vs_prefix_attention"] = float((ours.float() - ref.float()).abs().max())
            del ours, ref
    except Exception as exc:
        row["max_abs_diff_vs_prefix_attention"] = f"{type(exc).__name__}"
    torch.cuda.empty_cache()
    for name, exact, via in (
        ("ours", False, False),
        ("ours_exact", True, False),
        ("via_prefix", False, True),
        ("via_prefix_exact", True, True),
    ):
        row[name] = guarded(latent_step(q, pages, own, do, scale, exact=exact, via_prefix=via), reps)
    for name in ("", "_exact"):
        if "ms" in row["ours" + name] and "ms" in row["via_prefix" + name]:
            row["speedup_vs_prefix" + name] = round(row["via_prefix" + name]["ms"] / row["ours" + name]["ms"], 3)
    return row


# --------------------------------------------------------------------------------------------------------------------
# Fused head
# --------------------------------------------------------------------------------------------------------------------


def bench_fused_head(T: int, reps: int, seed: int, weight: torch.Tensor) -> dict:
    H = weight.shape[1]
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    targets = torch.randint(0, weight.shape[0], (T,), device="cuda", generator=g)
    row = {"T": T, "H": H, "V": weight.shape[0]}

    def ours():
        logprob, entropy = fused_logprob(hidden, weight, targets)
        (logprob.sum() + entropy.sum()).backward()
        hidden.grad = None

    def torch_logprob():
        logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
        logp.gather(-1, targets[:, None]).sum().backward()
        hidden.grad = None

    def torch_logprob_entropy():
        logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        (logp.gather(-1, targets[:, None]).sum() + entropy.sum()).backward()
        hidden.grad = None

    try:
        with torch.no_grad():
            lp, _ = fused_logprob(hidden, weight, targets)
            n = min(T, 1024)  # compare on the first rows only: the full reference is what we avoid materializing
            ref = torch.log_softmax((hidden[:n] @ weight.T).float(), -1).gather(-1, targets[:n, None]).squeeze(-1)
            row["max_abs_diff_logprob_vs_torch"] = float((lp[:n] - ref).abs().max())
            del lp, ref
    except Exception as exc:
        row["max_abs_diff_logprob_vs_torch"] = f"{type(exc).__name__}"
    torch.cuda.empty_cache()

    row["ours"] = guarded(ours, reps)
    row["torch_logprob"] = guarded(torch_logprob, reps)
    row["torch_logprob_entropy"] = guarded(torch_logprob_entropy, reps)
    row["logits_bf16_mb"] = round(T * weight.shape[0] * 2 / 2**20, 1)
    if "ms" in row["ours"] and "ms" in row["torch_logprob"]:
        row["speedup_vs_torch_logprob"] = round(row["torch_logprob"]["ms"] / row["ours"]["ms"], 3)
        row["memory_ratio_vs_torch_logprob"] = round(
            row["torch_logprob"]["peak_extra_mb"] / max(row["ours"]["peak_extra_mb"], 1e-3), 2
        )
    return row


# --------------------------------------------------------------------------------------------------------------------
# Expert LoRA
# --------------------------------------------------------------------------------------------------------------------


def bench_expert_lora(name: str, H: int, n_out: int, reps: int, seed: int, N: int = 32768, E: int = 128, r: int = 32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape, std=1.0: (torch.randn(*shape, device="cuda", generator=g) * std).to(torch.bfloat16)
    # Routed rows sorted by expert, with a skewed load (expert weights uniform in [0, 1)).
    counts = torch.multinomial(torch.rand(E, device="cuda", generator=g), N, replacement=True, generator=g)
    counts = counts.bincount(minlength=E)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    sizes = counts.tolist()
    x = rnd(N, H).requires_grad_()
    W = rnd(E, n_out, H, std=H**-0.5)  # frozen base expert weights
    lora_A = rnd(E * r, H, std=H**-0.5).requires_grad_()
    lora_B = rnd(n_out, r * E, std=r**-0.5).requires_grad_()
    A, B, s = lora_A.view(E, r, H), lora_B.view(n_out, r, E).permute(2, 0, 1), 2.0
    dy = rnd(N, n_out)
    row = {"proj": name, "N": N, "E": E, "H": H, "O": n_out, "r": r, "max_rows_per_expert": max(sizes)}

    def grouped(x_N_H, W_E_O_H):
        # split/unbind, not slicing: their backward is one cat/stack, where E slices would each add a zero-filled
        # full-size gradient (E x 805 MB for PEFT's [E, O, H] weight).
        pairs = zip(x_N_H.split(sizes), W_E_O_H.unbind(0), strict=True)
        return torch.cat([x_e @ W_e.T for x_e, W_e in pairs])

    def step(forward):
        def run():
            forward().backward(dy)
            for t in (x, lora_A, lora_B):
                t.grad = None

        return run

    ours = lambda: grouped(x, W) + expert_lora(x, A, B, offsets, s)
    peft = lambda: grouped(x, W + s * torch.einsum("o r e, e r i -> e o i", lora_B.view(n_out, r, E), A))
    try:
        with torch.no_grad():
            row["max_abs_diff_vs_peft"] = float((ours().float() - peft().float()).abs().max())
    except Exception as exc:
        row["max_abs_diff_vs_peft"] = f"{type(exc).__name__}"
    torch.cuda.empty_cache()
    row["ours"] = guarded(step(ours), reps)
    row["reference"] = guarded(step(lambda: grouped(x, W) + expert_lora_reference(x, A, B, offsets, s)), reps)
    row["peft"] = guarded(step(peft), reps)
    row["lora_only"] = guarded(step(lambda: expert_lora(x, A, B, offsets, s)), reps)
    row["delta_weight_bf16_mb"] = round(E * n_out * H * 2 / 2**20, 1)
    if "ms" in row["ours"] and "ms" in row["peft"]:
        row["speedup_vs_peft"] = round(row["peft"]["ms"] / row["ours"]["ms"], 3)
        row["memory_ratio_vs_peft"] = round(row["peft"]["peak_extra_mb"] / max(row["ours"]["peak_extra_mb"], 1e-3), 2)
    return row


def targets_met(attn_rows: list[dict], head_rows: list[dict]) -> dict:
    met = {}
    eligible = [r for r in attn_rows if r["P"] / r["R"] >= 16 and "speedup_vs_sdpa" in r]
    if eligible:
        met["prefix_attention_1.5x_vs_sdpa_when_P/R>=16"] = all(r["speedup_vs_sdpa"] >= 1.5 for r in eligible)
    for r in head_rows:
        if r["T"] == 32768 and "memory_ratio_vs_torch_logprob" in r:
            met["fused_head_10x_less_memory_at_T=32k"] = r["memory_ratio_vs_torch_logprob"] >= 10
            met["fused_head_no_slower_at_T=32k"] = r["speedup_vs_torch_logprob"] >= 1.0
    return met


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        reason = "CUDA is not available: bench/kernels_gpu.py measures GPU kernels only; nothing was measured"
        print(f"skipped: {reason}")
        print(json.dumps({"bench": "kernels_gpu", "skipped": True, "reason": reason}))
        return

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    attn_sizes = [(8192, 512)] if args.quick else [(p, r) for p in (8192, 65536, 524288) for r in (512, 4096)]
    head_sizes = [4096] if args.quick else [4096, 32768]
    lora_projs = [("gate_up", 2048, 1536)] + ([] if args.quick else [("down", 768, 2048)])
    latent_sizes = [(8192, 64)] + ([] if args.quick else [(65536, 64), (65536, 512)])
    attn_rows, head_rows, lora_rows, latent_rows, skipped = [], [], [], [], []

    for P, R in attn_sizes:
        if time.perf_counter() - t0 > BUDGET_S:
            skipped.append(f"prefix_attention P={P} R={R}")
            continue
        row = bench_prefix_attention(P, R, args.reps, args.seed)
        attn_rows.append(row)
        print(f"prefix_attention P={P} R={R}: {json.dumps(row)}", file=sys.stderr, flush=True)

    weight = torch.randn(151936, 4096, device="cuda", dtype=torch.bfloat16) * 0.02  # frozen head
    for T in head_sizes:
        if time.perf_counter() - t0 > BUDGET_S:
            skipped.append(f"fused_head T={T}")
            continue
        row = bench_fused_head(T, args.reps, args.seed, weight)
        head_rows.append(row)
        print(f"fused_head T={T}: {json.dumps(row)}", file=sys.stderr, flush=True)
    del weight
    torch.cuda.empty_cache()

    for name, H, n_out in lora_projs:
        if time.perf_counter() - t0 > BUDGET_S:
            skipped.append(f"expert_lora {name}")
            continue
        row = bench_expert_lora(name, H, n_out, args.reps, args.seed)
        lora_rows.append(row)
        print(f"expert_lora {name}: {json.dumps(row)}", file=sys.stderr, flush=True)

    for P, R in latent_sizes:
        if time.perf_counter() - t0 > BUDGET_S:
            skipped.append(f"latent_prefix_attention P={P} R={R}")
            continue
        row = bench_latent_attention(P, R, args.reps, args.seed)
        latent_rows.append(row)
        print(f"latent_prefix_attention P={P} R={R}: {json.dumps(row)}", file=sys.stderr, flush=True)

    result = {
        "bench": "kernels_gpu",
        "skipped": False,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),  # not `import triton`: only kernels/ imports it
        "dtype": "bfloat16",
        "prefix_attention": attn_rows,
        "fused_head": head_rows,
        "expert_lora": lora_rows,
        "latent_prefix_attention": latent_rows,
        "targets_met": targets_met(attn_rows, head_rows),
        "skipped_for_time": skipped,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
