"""Peer benchmark: TRL GRPOTrainer (PEFT LoRA) vs LongStraw exact (the same gradient), one GRPO step, same model.

Usage (bench-only dependency: `pip install trl`; `make bench` installs it):
    python bench/peer_trl.py                      # P=2048, G=4, R=64, vocab 32000, then the same at vocab 256; CPU
    python bench/peer_trl.py --second-vocab 0     # the first size only
    python bench/peer_trl.py --prompt-len 4096 --response-len 128 --trl-batch 2

Like for like: TRL back-propagates through the whole prompt+completion sequence, so its gradient is full backprop.
LongStraw *exact* mode accumulates that same gradient, so `trl_over_exact_memory` / `trl_over_exact_time` are the
headline. LongStraw *detached* mode holds the prompt's K/V constant (a response-only gradient, cheaper and not the
same thing); it is measured as a second row, `trl_over_detached_*`, and is not a like-for-like comparison.

Every side runs in a fresh Python process with MALLOC_MMAP_THRESHOLD_=65536 (as bench/longstraw_memory.py does), and
builds the model with bench/longstraw_memory.py's `build` (tiny Qwen3-MoE from a config, no download, PEFT LoRA from
mint's default [lora] section, lora_B drawn N(0, 0.01)). Memory is LongStraw's PeakMeter: CPU VmHWM reset through
/proc/self/clear_refs, minus VmRSS at the baseline. Each worker reports `peak_meter_reset`; where the reset did not
work the peak is the process-lifetime peak, and the summary's `peak_note` says so. Threads per process: --threads
(default 1).

LongStraw side: `bench/longstraw_memory.py --worker exact` and `--worker detached` with the same sizes, unchanged.
The measured interval is one `grpo_update` over P prompt tokens and G given responses of R tokens (prompt capture,
G replays with backward, and in exact mode the chunked prompt backward), *without* the optimizer step and without
generation; need_ref is off (its default), so no reference pass.

TRL side (`--worker trl`): GRPOTrainer(model=<that PeftModel>, args=GRPOConfig(...)), TRL defaults except:
  per_device_train_batch_size = --trl-batch (default 1: one sequence per forward, TRL's most frugal setting, like
  the naive step of longstraw_memory), gradient_accumulation_steps = G / batch so that one optimizer step consumes
  exactly one group of G completions from one prompt; num_generations = G; max_completion_length = R with
  generation_kwargs min_new_tokens = R, so EOS cannot be sampled and every completion has exactly R tokens (checked);
  the prompt is P tokens of a local word-level tokenizer (checked; TRL 1.x does not truncate prompts); bf16 off
  (fp32, like the LongStraw side); gradient checkpointing = TRL's default (on) unless --trl-no-grad-ckpt; beta = 0
  (TRL's default: no reference model, matching need_ref off); lr 1e-5 as in longstraw_memory; max_steps = 2.
Step 1 is a warm-up (optimizer state, allocator). In step 2 the measured interval starts right AFTER TRL's
`_prepare_inputs` of the first micro-batch returns, i.e. after generation (model.generate of all G completions),
reward computation and advantage computation, and ends in `on_optimizer_step`, right after optimizer.step().
So it includes: G/batch micro-steps of TRL's compute_loss (full-sequence forward, its fused LM head giving
log-probabilities and entropies, the clipped GRPO loss) and backward (with gradient-checkpointing recompute when on),
plus the AdamW step over the LoRA parameters (LoRA-sized: `lora_param_bytes`). It excludes generation time and
memory (the generated batch is part of the baseline). The LongStraw side excludes the optimizer step, which favours
LongStraw by that small step.

TRL's LM head on CPU (trl 1.16). Read in its source (trl/trainer/utils.py `add_fused_lm_head`,
trl/kernels/chunked_logprob.py): TRL labels the prompt positions -100 and calls a fused head. Where Triton runs
(CUDA/XPU; not run here, no GPU) that head passes only the labelled rows to `ChunkedLogProbFunction`; elsewhere, CPU
included, it passes all P+R-1 shifted positions and zeroes the prompt rows afterwards. The function computes logits
in tiles of min(rows, 4096) x min(V, 32768), and its torch fallback makes several fp32 temporaries of a tile's size,
in forward and again in backward. Measured here, not assumed: the TRL worker wraps that function and records the
rows of every call with grad in the measured interval (`trl_logits_rows_per_sequence`; `trl_logits_positions` is
"prompt+completion" when they are P+R-1, "completion" when they are R). It also meters the function alone, forward
and backward as TRL's training calls it, over P+R-1 rows and over R rows (`trl_lm_head_probe_mib`), which sizes the
part of TRL's peak that is this CPU-only all-positions head. A forward hook on lm_head would see nothing: the fused
head reads lm_head.weight directly.

Second size (`--second-vocab`, default 256; 0 skips it): the same model, P, G, R and LoRA with the vocabulary cut from
32000 to 256. The knob is the vocabulary because on CPU the all-positions head costs TRL O(min(P+R, 4096) * V) bytes and
inside the measured interval V scales nothing else (the embedding and head weights are in the baseline): P, the
attention and MoE activations and the LoRA stay as they are, and LongStraw's own scoring term shrinks with V as well.
Shortening P instead would shrink exactly what LongStraw bounds (its prefix) together with the head, and the head would
still set TRL's peak (in a smoke run at P=256, G=2, R=16 the head alone measured 274 MiB of TRL's 277 MiB). Why 256 and
not a more usual size, measured on CPU-2 at P=2048, G=4, R=64 with `--worker trl --vocab V`: TRL's peak was 2150 MiB at
V=32000 (the head alone 2134 MiB), 94.3 MiB at V=1024 (head 78.3), 70.8 MiB at V=256 (head 24.6) and 70.7 MiB at V=128
(head 17.4). So V=1024 is still head-bound and 256 is the largest of these at which the head no longer sets TRL's peak.
The second size answers "how do the two compare when TRL's CPU-only head cost is out of the way"; it is not a realistic
model (V equals the hidden size).

The last line printed is one JSON object: the four ratios of the first size (`trl_over_exact_memory` first), TRL's
measured logits rows, `peak_meter_reset`, the sizes, the runs, and under `second_size` the same for the second size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONGSTRAW_BENCH = os.path.join(ROOT, "bench", "longstraw_memory.py")
# Flags shared with bench/longstraw_memory.py (same names, forwarded to it and to its `build`).
SHARED = {
    "prompt_len": 2048,
    "group": 4,
    "response_len": 64,
    "chunk": 1024,
    "hidden": 256,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "experts": 8,
    "top_k": 2,
    "moe_intermediate": 256,
    "vocab": 32000,
    "threads": 1,
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in SHARED.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    ap.add_argument("--second-vocab", type=int, default=256, help="vocab of the second size; 0: first size only")
    ap.add_argument("--trl-batch", type=int, default=1, help="TRL per_device_train_batch_size; must divide G")
    ap.add_argument("--trl-no-grad-ckpt", action="store_true", help="turn off TRL's default gradient checkpointing")
    ap.add_argument("--no-malloc-tune", action="store_true", help="CPU: keep glibc's dynamic mmap threshold")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.group % args.trl_batch:
        ap.error("--trl-batch must divide --group")
    return args


def shared_flags(args) -> list[str]:
    return [x for name in SHARED for x in ("--" + name.replace("_", "-"), str(getattr(args, name)))]


# -- TRL worker ----------------------------------------------------------------------------------------------------


def tokenizer(vocab: int):
    """Word-level tokenizer over "t<id>" words: a prompt of P words is exactly P token ids, no special tokens added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def trl_worker(args) -> dict:
    import importlib.util

    import trl.trainer.utils as trl_utils
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE

    from longstraw.memory import PeakMeter

    spec = importlib.util.spec_from_file_location("longstraw_memory", LONGSTRAW_BENCH)
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)

    torch.set_num_threads(args.threads)
    model, _, _ = lm.build(lm.parse_args(shared_flags(args)))  # its own AdamW is unused: TRL builds one
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = None
    P, G, R = args.prompt_len, args.group, args.response_len

    gen = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"t{i}" for i in torch.randint(2, args.vocab, (P,), generator=gen).tolist()) for _ in range(4)]

    def reward(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]

    state = {"armed": False, "t0": None, "meter": PeakMeter(torch.device("cpu")), "result": None, "checks": []}
    state["head_rows"] = []  # rows fed to TRL's fused LM head, per call with grad in the measured interval

    # TRL's fused head looks this name up in trl.trainer.utils at call time, so a wrapper there sees every call.
    fused = trl_utils._ChunkedLogProbFunction

    class CountingHead:
        @staticmethod
        def apply(hidden, *rest):
            if state["t0"] is not None and state["result"] is None and torch.is_grad_enabled():
                state["head_rows"].append(int(hidden.shape[0]))
            return fused.apply(hidden, *rest)

    trl_utils._ChunkedLogProbFunction = CountingHead

    class Trainer(GRPOTrainer):
        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            if self.model.training:
                state["checks"].append(
                    (int(inputs["prompt_ids"].shape[1]), inputs["completion_mask"].sum(dim=1).tolist())
                )
            if state["armed"] and state["t0"] is None:  # generation of this step's group is done: baseline here
                gc.collect()
                state["meter"].start()
                state["t0"] = time.perf_counter()
            return inputs

    class Measure(TrainerCallback):
        def on_step_begin(self, targs, tstate, control, **kwargs):
            state["armed"] = tstate.global_step == 1  # step 0 is the warm-up

        def on_optimizer_step(self, targs, tstate, control, **kwargs):
            if state["armed"] and state["t0"] is not None and state["result"] is None:
                seconds = time.perf_counter() - state["t0"]
                state["result"] = {"peak_bytes": state["meter"].peak(), "seconds": seconds}
                state["meter_report"] = state["meter"].report()

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.trl_batch,
            gradient_accumulation_steps=G // args.trl_batch,
            num_generations=G,
            max_completion_length=R,
            generation_kwargs={"min_new_tokens": R},
            learning_rate=1e-5,
            max_steps=2,
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=not args.trl_no_grad_ckpt,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = Trainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer(args.vocab),
            callbacks=[Measure()],
        )
        trainer.train()

    if state["result"] is None:
        raise RuntimeError("the measured step did not run")
    for plen, clens in state["checks"]:
        if plen != P or any(c != R for c in clens):
            raise RuntimeError(f"TRL batch is not P={P}, R={R}: prompt {plen}, completions {clens}")
    # One call per micro-batch is expected; anything else is reported as "other" rather than guessed at.
    rows_seen = {n // args.trl_batch for n in state["head_rows"]}
    expected_calls = len(state["head_rows"]) == G // args.trl_batch
    rows = rows_seen.pop() if len(rows_seen) == 1 and expected_calls else None
    positions = {P + R - 1: "prompt+completion", R: "completion"}.get(rows, "other")
    weight = model.get_output_embeddings().weight
    probe = {
        "all_positions": head_probe(fused, weight, P + R - 1, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE),
        "completion_only": head_probe(fused, weight, R, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE),
    }
    lora_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {
        "config": "trl",
        **state["result"],
        **state["meter_report"],
        "logits_rows_per_sequence": rows,
        "logits_rows_per_call": state["head_rows"],
        "logits_positions": positions,
        "token_chunk": TOKEN_CHUNK_SIZE,
        "lm_head_probe_bytes": probe,
        "lora_param_bytes": lora_bytes,
        "micro_batches": len(state["checks"]),
        "trl_batch": args.trl_batch,
        "gradient_checkpointing": not args.trl_no_grad_ckpt,
        "trl_version": __import__("trl").__version__,
    }


def head_probe(fused, weight: torch.Tensor, rows: int, vocab_chunk: int) -> int:
    """Measured peak bytes of TRL's fused LM head alone, forward and backward, over `rows` positions.

    Called as TRL's training forward calls it: log-probs and entropies requested, grad into the hidden states only
    (the head is frozen), the loss on the log-probs.
    """
    from longstraw.memory import PeakMeter

    hidden_N_H = torch.randn(rows, weight.shape[1], dtype=weight.dtype, requires_grad=True)
    targets_N = torch.randint(0, weight.shape[0], (rows,))
    gc.collect()
    meter = PeakMeter(torch.device("cpu"))
    meter.start()
    logp_N, *_ = fused.apply(hidden_N_H, weight, None, targets_N, 1.0, vocab_chunk, None, 1.0, ("log_probs", "entropy"))
    logp_N.sum().backward()
    peak = meter.peak()
    del logp_N, hidden_N_H
    return peak


# -- driver ----------------------------------------------------------------------------------------------------------


def run(args, cmd: list[str], name: str) -> dict:
    env = dict(os.environ)
    if not args.no_malloc_tune:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return {"config": name, "error": f"exit {proc.returncode}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - t0, 1)
    return result


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def compare(args) -> dict:
    """Exact, detached and TRL at one size, each in a fresh process: the four ratios, TRL's head rows, the runs."""
    flags = shared_flags(args)
    exact = run(args, [LONGSTRAW_BENCH, *flags, "--worker", "exact"], "exact")
    detached = run(args, [LONGSTRAW_BENCH, *flags, "--worker", "detached"], "detached")
    trl_flags = ["--trl-batch", str(args.trl_batch)] + (["--trl-no-grad-ckpt"] if args.trl_no_grad_ckpt else [])
    trl = run(args, [os.path.abspath(__file__), *flags, *trl_flags, "--worker", "trl"], "trl")
    runs = [exact, detached, trl]

    print(f"P={args.prompt_len} G={args.group} R={args.response_len} vocab={args.vocab}")
    for r in runs:
        if "error" in r:
            print(f"  {r['config']:10s} {r['error']}")
        else:
            print(f"  {r['config']:10s} peak {r['peak_bytes'] / 2**20:9.1f} MiB  {r['seconds']:7.2f} s")

    reset = [r.get("peak_meter_reset") for r in runs if "error" not in r]
    not_reset = [r["config"] for r in runs if r.get("peak_meter_reset") is False]
    probe = trl.get("lm_head_probe_bytes") or {}
    return {
        "trl_over_exact_memory": ratio(trl.get("peak_bytes"), exact.get("peak_bytes")),
        "trl_over_exact_time": ratio(trl.get("seconds"), exact.get("seconds")),
        "trl_over_detached_memory": ratio(trl.get("peak_bytes"), detached.get("peak_bytes")),
        "trl_over_detached_time": ratio(trl.get("seconds"), detached.get("seconds")),
        "trl_logits_positions": trl.get("logits_positions"),
        "trl_logits_rows_per_sequence": trl.get("logits_rows_per_sequence"),
        "trl_lm_head_probe_mib": {k: round(v / 2**20, 1) for k, v in probe.items()},
        "peak_meter_reset": all(x is True for x in reset) if reset else None,
        "peak_note": (
            "peak is the process-lifetime peak (the peak reset did not work) for: " + ", ".join(not_reset)
            if not_reset
            else "peak covers the measured interval only (the peak reset worked in every worker)"
        ),
        "P": args.prompt_len,
        "G": args.group,
        "R": args.response_len,
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts")}
        | {"top_k": args.top_k, "vocab": args.vocab},
        "runs": runs,
    }


def main() -> None:
    args = parse_args()
    if args.worker == "trl":
        print(json.dumps(trl_worker(args)))
        return
    first = compare(args)
    second = compare(argparse.Namespace(**{**vars(args), "vocab": args.second_vocab})) if args.second_vocab else None
    for name, block in (("first", first), ("second", second)):
        if block is not None:
            print(
                f"{name} size (vocab {block['model']['vocab']}): TRL/exact memory {block['trl_over_exact_memory']}"
                f" time {block['trl_over_exact_time']} (same gradient); TRL/detached memory"
                f" {block['trl_over_detached_memory']} time {block['trl_over_detached_time']} (response-only)"
            )
    runs = first.pop("runs")
    summary = {
        **first,
        "device": "cpu",
        "dtype": "float32",
        "chunk": args.chunk,
        "threads": args.threads,
        "malloc_mmap_threshold": None if args.no_malloc_tune else 65536,
        "trl_batch": args.trl_batch,
        "trl_gradient_checkpointing": not args.trl_no_grad_ckpt,
        "second_size": second,
        "runs": runs,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
