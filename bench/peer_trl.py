"""Peer benchmark: TRL's GRPOTrainer (PEFT LoRA) vs LongStraw detached, one GRPO optimizer step, same model and sizes.

Usage (bench-only dependency: `pip install trl`; `make bench` installs it):
    python bench/peer_trl.py                                   # P=2048, G=4, R=64, CPU, ~a few minutes on 2 cores
    python bench/peer_trl.py --prompt-len 4096 --response-len 128 --trl-batch 2

Both sides run in fresh Python processes with MALLOC_MMAP_THRESHOLD_=65536 (as bench/longstraw_memory.py does), and
both build the model with bench/longstraw_memory.py's `build` (tiny Qwen3-MoE from a config, no download, PEFT LoRA
from mint's default [lora] section, lora_B drawn N(0, 0.01)). Memory is LongStraw's PeakMeter: CPU VmHWM reset
through /proc/self/clear_refs, minus VmRSS at the baseline. Threads per process: --threads (default 1).

LongStraw side: `bench/longstraw_memory.py --worker detached` with the same sizes, unchanged. Its measured interval is
one `grpo_update` over P prompt tokens and G given responses of R tokens (prompt capture, G replays with backward),
*without* the optimizer step and without generation; need_ref is off (its default), so no reference pass.

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
So it includes: G/batch micro-steps of TRL's compute_loss (full-sequence forward over prompt+completion with
logits for the completion positions, selective log-softmax, entropies, the clipped GRPO loss) and backward (with
gradient-checkpointing recompute when on), plus the AdamW step over the LoRA parameters (small: LoRA-sized). It
excludes generation time and memory (the generated batch is part of the baseline). The LongStraw side excludes the
optimizer step; on these sizes that step is a small fraction of TRL's interval, so it favours LongStraw slightly.

The last line printed is one JSON object: `trl_over_detached_memory`, `trl_over_detached_time`, the sizes, both runs.
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

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

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
    lora_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {
        "config": "trl",
        **state["result"],
        "lora_param_bytes": lora_bytes,
        "micro_batches": len(state["checks"]),
        "trl_batch": args.trl_batch,
        "gradient_checkpointing": not args.trl_no_grad_ckpt,
        "trl_version": __import__("trl").__version__,
    }


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


def main() -> None:
    args = parse_args()
    if args.worker == "trl":
        print(json.dumps(trl_worker(args)))
        return
    flags = shared_flags(args)
    detached = run(args, [LONGSTRAW_BENCH, *flags, "--worker", "detached"], "detached")
    trl_flags = ["--trl-batch", str(args.trl_batch)] + (["--trl-no-grad-ckpt"] if args.trl_no_grad_ckpt else [])
    trl = run(args, [os.path.abspath(__file__), *flags, *trl_flags, "--worker", "trl"], "trl")

    for r in (detached, trl):
        if "error" in r:
            print(f"{r['config']:10s} {r['error']}")
        else:
            print(f"{r['config']:10s} peak {r['peak_bytes'] / 2**20:9.1f} MiB  {r['seconds']:7.2f} s")

    def ratio(key):
        a, b = trl.get(key), detached.get(key)
        return round(a / b, 3) if a is not None and b else None

    summary = {
        "device": "cpu",
        "dtype": "float32",
        "P": args.prompt_len,
        "G": args.group,
        "R": args.response_len,
        "chunk": args.chunk,
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts")}
        | {"top_k": args.top_k, "vocab": args.vocab},
        "threads": args.threads,
        "malloc_mmap_threshold": None if args.no_malloc_tune else 65536,
        "trl_batch": args.trl_batch,
        "trl_gradient_checkpointing": not args.trl_no_grad_ckpt,
        "trl_over_detached_memory": ratio("peak_bytes"),
        "trl_over_detached_time": ratio("seconds"),
        "runs": [detached, trl],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
