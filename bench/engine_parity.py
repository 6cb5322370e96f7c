"""Mint against a real vLLM: vLLM's CPU build (`make engines`) serving the dense tiny Qwen3 in fp32, LoRA hot-loaded.

One vLLM server is started on 127.0.0.1 with Mint's default launch line (`launch_argv`, as `engines.start` starts
it), then:

1. a GRPO run (`recipes/smoke.toml` on `tiny:qwen3`, one learner rank) rolls out on it through `engines.urls`: every
   step's revision is loaded in place before the step's rollout, and the learner logs `logp_diff_max`, the largest
   |learner - engine| logprob of the engine's tokens. `vllm_vs_learner_logprob_maxdiff` is its maximum over the steps
   after the first (from step 2 on the adapter is no longer the zero-B initial one); the reward curve is the run's.
2. `vllm_lora_load_seconds`: each revision the run saved is loaded again (`/v1/load_lora_adapter`, in place), timed
   from the request to vLLM's answer; median and max.
3. `engine_tokens_per_s`: the same requests (the task's chat prompts x G at temperature 1, up to --max-tokens each)
   through Mint's vllm backend and through the built-in engine holding the same final revision, interleaved, median
   of --repeats timed calls after one warm-up; tokens are counted as sampled (a row ends at eos on either side).
   `builtin_over_vllm_cpu_tokens_per_s` is their ratio: vLLM's CPU build against our CPU path, not vLLM on a GPU.

    python bench/engine_parity.py                       # 60 steps, about 5 minutes on 2 cores
    python bench/engine_parity.py --steps 120 --repeats 5

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-env", default=str(ROOT / ".engines/vllm"), help="the engine virtualenv")
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps of the run through vLLM")
    # 8 x G=8 is a training step's batch. vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset") when a
    # seeded request's prefill is split over scheduler steps, which 16 x 8 of these prompts already caused here.
    parser.add_argument("--prompts", type=int, default=8, help="prompts per throughput call")
    parser.add_argument("--group", type=int, default=8, help="G per prompt in the throughput calls")
    parser.add_argument("--max-tokens", type=int, default=16, help="most tokens per completion (throughput calls)")
    parser.add_argument("--repeats", type=int, default=3, help="timed throughput calls per engine; median reported")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds vLLM may take to start")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from mint.config import load_config
    from mint.models.tiny import resolve_model_path
    from mint.rl.data import load_dataset
    from mint.rollout.backends import VllmBackend
    from mint.rollout.backends.builtin import BuiltinBackend
    from mint.rollout.engine import RolloutEngine, SamplingParams
    from mint.rollout.prompts import prompt_tokens
    from mint.train.driver import train
    from mint.train.engine_servers import EngineServer

    engine_bin = Path(args.engine_env) / "bin"
    if not (engine_bin / "vllm").exists():
        sys.exit(f"engine_parity: no vLLM at {engine_bin}; `make engines` installs vLLM's CPU build there")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes 92% of a NUMA node
    model_path = resolve_model_path("tiny:qwen3")
    work = Path(tempfile.mkdtemp(prefix="mint-engine-parity-"))
    overrides = [
        "model.path=tiny:qwen3",
        f"grpo.steps={args.steps}",
        "learner.num_ranks=1",
        "rollout.backend=vllm",
        "engines.start=1",
        f"engines.path={engine_bin}",
        f"logging.root={work}",
        "logging.name=parity",
        "logging.progress=false",
    ]
    launch = load_config(ROOT / "recipes/smoke.toml", overrides)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PATH": f"{engine_bin}:{os.environ['PATH']}"}
    values = {"model": model_path, "moe": False, "host": "127.0.0.1"}
    t0 = time.perf_counter()
    server = EngineServer(0, launch, values, str(work / "vllm.log"), env, 0, args.start_timeout)
    try:
        url = server.wait_healthy(args.start_timeout)
        start_s = time.perf_counter() - t0
        print(f"engine_parity: vLLM up at {url} in {start_s:.0f} s", file=sys.stderr)

        # 1. the run, rolling out on that server
        config = load_config(
            ROOT / "recipes/smoke.toml",
            [o for o in overrides if not o.startswith(("engines.start", "engines.path"))]
            + [f"engines.urls={json.dumps([url])}"],
        )
        t0 = time.perf_counter()
        summary = train(config)
        run_s = time.perf_counter() - t0
        lines = [json.loads(line) for line in (work / "parity/metrics.jsonl").read_text().splitlines()]
        diffs = [m["logp_diff_max"] for m in lines]
        rewards = [round(m["reward_mean"], 4) for m in lines]

        # 2. load every saved revision again, timed
        client = httpx.Client(timeout=60.0)
        adapters = sorted((work / "parity/adapters").glob("step_*"))
        load_s = []
        for directory in adapters:
            body = {"lora_name": "mint-policy", "lora_path": str(directory), "load_inplace": True}
            t0 = time.perf_counter()
            response = client.post(url + "/v1/load_lora_adapter", json=body)
            load_s.append(time.perf_counter() - t0)
            response.raise_for_status()
        client.close()

        # 3. the same requests through vLLM and through the built-in engine, both holding the final revision
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        examples = load_dataset(config.data.source).take(args.prompts, seed=1)
        token_ids = [prompt_tokens(tokenizer, example) for example in examples]
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        final = adapters[-1]
        model = PeftModel.from_pretrained(base, str(final)).eval()
        eos = sorted({base.generation_config.eos_token_id, tokenizer.eos_token_id} - {None})
        builtin = BuiltinBackend(RolloutEngine(model, eos))
        vllm = VllmBackend([url], None, timeout=600.0)
        vllm.load_adapter(summary["revision"], final)
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
        timings: dict[str, list[float]] = {"builtin": [], "vllm": []}
        for repeat in range(args.repeats + 1):  # the first round warms both up and is not timed
            for name, backend in (("vllm", vllm), ("builtin", builtin)):
                t0 = time.perf_counter()
                groups = backend.generate(token_ids, args.group, params, seed=repeat)
                seconds = time.perf_counter() - t0
                tokens = sum(len(c.tokens_R) for g in groups for c in g.completions)
                if repeat:
                    timings[name].append(tokens / seconds)
        vllm.close()
    finally:
        server.stop()

    vllm_tps, builtin_tps = statistics.median(timings["vllm"]), statistics.median(timings["builtin"])
    result = {
        "bench": "engine_parity",
        "engine": "vllm-cpu 0.32.0 (its own virtualenv), fp32, LoRA rank 8 on q/k/v/o_proj",
        "model": "tiny:qwen3",
        "vllm_start_seconds": round(start_s, 1),
        "steps": len(lines),
        "run_seconds": round(run_s, 1),
        "vllm_vs_learner_logprob_maxdiff": max(diffs[1:]) if len(diffs) > 1 else None,
        "logp_diff_max_step1": diffs[0],
        "vllm_lora_load_seconds": {
            "median": round(statistics.median(load_s), 4),
            "max": round(max(load_s), 4),
            "revisions": len(load_s),
        },
        "engine_tokens_per_s": {"vllm_cpu": round(vllm_tps, 1), "builtin": round(builtin_tps, 1)},
        "builtin_over_vllm_cpu_tokens_per_s": round(builtin_tps / vllm_tps, 3),
        "throughput_requests": {"prompts": len(token_ids), "group": args.group, "max_tokens": args.max_tokens},
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        "reward_gain": summary["reward_gain"],
        "reward_curve": rewards,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
