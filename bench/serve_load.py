"""`mint serve` under a bounded burst: the batched server against the same server one request at a time.

Builds a tiny random Qwen3-MoE with the embedded tokenizer and a catalog with one LoRA revision (nothing is
downloaded), then, for each configuration in turn, starts `python -m mint.cli serve` on 127.0.0.1 (a free port, the
revision loaded as "a") and fires `--requests` completions from `--clients` concurrent official-`openai` clients
(threads, each with its own connection pool), all within `--time-limit` seconds per configuration. Every request
asks for exactly `--max-tokens` tokens (`ignore_eos`), so tokens/s compares like with like.

    batched   --max-batch 64 (the default): concurrent requests share decode steps
    serial    --max-batch 1: one request at a time, the old server's behaviour

Both runs use the same seeds, so the tokens of each request are compared across them too (`same_tokens_fraction`;
batching may move logprobs by float reassociation, about 1e-6, never the seed's draws).

    nice .venv/bin/python bench/serve_load.py                       # 200 requests, 50 clients, 32 tokens each
    python bench/serve_load.py --requests 400 --clients 100 --device cuda

Traffic stays on the loopback interface. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per configuration")
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (ignore_eos: exactly this many)")
    parser.add_argument("--max-batch", type=int, default=64, help="--max-batch of the batched server")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per configuration, all requests")
    parser.add_argument("--device", default="cpu", help="the server's --device")
    parser.add_argument("--work", default=None, help="directory for the base and catalog (default: a temp dir)")
    return parser.parse_args()


def build_world(work: Path) -> tuple[str, str]:
    """A tiny random Qwen3-MoE with the embedded tokenizer, and a catalog holding one random LoRA revision."""
    import torch
    from transformers import AutoModelForCausalLM

    from mint.config import LoraConfig
    from mint.hub import Catalog, base_fingerprint
    from mint.models.lora import adapter_config_dict, add_lora, load_lora_state, lora_state
    from mint.models.specs import load_model, tiny_config
    from mint.models.tiny import VOCAB_SIZE, build_tokenizer

    base = str(work / "base")
    torch.manual_seed(0)
    config = tiny_config("qwen3_moe", VOCAB_SIZE, initializer_range=0.05, max_position_embeddings=1024)
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    build_tokenizer().save_pretrained(base)
    model = add_lora(load_model(base), LoraConfig(), seed=0)
    g = torch.Generator().manual_seed(1)
    load_lora_state(model, {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in lora_state(model).items()})
    adapter_config = json.loads(json.dumps(adapter_config_dict(model, base)))
    with Catalog(work / "catalog") as cat:
        rid = cat.put(
            lora_state(model), adapter_config, run="bench", step=1, parent=None, base_fingerprint=base_fingerprint(base)
        ).id
    return base, rid


def start(base: str, catalog: str, rid: str, max_batch: int, device: str, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "mint.cli",
        "serve",
        "--base",
        base,
        "--catalog",
        catalog,
        "--host",
        HOST,
        "--port",
        "0",
        "--load",
        f"a={rid}",
        "--max-batch",
        str(max_batch),
        "--device",
        device,
        "--max-queue",
        "100000",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)  # noqa: SIM115
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        return proc, json.loads(lines.get(timeout=180))["url"]
    except (queue.Empty, ValueError):
        proc.kill()
        raise SystemExit(f"server did not start: {log.read_text()[-2000:]}") from None


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


PROMPTS = [
    "What is the last digit of 3 7 1 4?",
    "Count from zero to nine:",
    "A model with experts routes each token to a layer;",
    "12 + 30 =",
    "Please say yes or no, true or false.",
]


def burst(url: str, args: argparse.Namespace) -> dict:
    """Fire `requests` completions from `clients` threads; every request ends within the time limit."""
    import openai

    deadline = time.monotonic() + args.time_limit
    todo: queue.Queue = queue.Queue()
    for i in range(args.requests):
        todo.put(i)
    results: dict[int, dict] = {}
    errors: list[str] = []

    def client_loop() -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                errors.append(f"{i}: not sent, time limit reached")
                continue
            start = time.monotonic()
            try:
                out = client.completions.create(
                    model="a",
                    prompt=PROMPTS[i % len(PROMPTS)] * (1 + i % 3),
                    max_tokens=args.max_tokens,
                    temperature=1.0,
                    seed=i,
                    timeout=left,
                    extra_body={"ignore_eos": True},
                )
            except Exception as err:
                errors.append(f"{i}: {type(err).__name__}: {str(err)[:100]}")
                continue
            results[i] = dict(
                latency=time.monotonic() - start,
                tokens=out.usage.completion_tokens,
                token_ids=out.choices[0].model_extra["token_ids"],
            )

    start = time.monotonic()
    threads = [threading.Thread(target=client_loop) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    latencies = sorted(r["latency"] for r in results.values())
    tokens = sum(r["tokens"] for r in results.values())
    with urllib.request.urlopen(url + "/health", timeout=30) as resp:
        health = json.loads(resp.read())

    def pct(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) if latencies else float("nan")

    return dict(
        sent=args.requests,
        answered=len(results),
        answered_fraction=len(results) / args.requests,
        p50_latency_s=round(statistics.median(latencies), 3) if latencies else float("nan"),
        p99_latency_s=pct(0.99),
        tokens_per_s=round(tokens / wall, 1),
        wall_s=round(wall, 2),
        largest_batch=health.get("max_batch_seen"),
        decode_steps=health.get("steps"),
        errors=errors[:5],
        _tokens={i: r["token_ids"] for i, r in results.items()},
    )


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        base, rid = build_world(work)
        runs = {}
        for name, max_batch in (("batched", args.max_batch), ("serial", 1)):
            proc, url = start(base, str(work / "catalog"), rid, max_batch, args.device, work / f"{name}.log")
            try:
                runs[name] = burst(url, args)
            finally:
                stop(proc)
            shown = {k: v for k, v in runs[name].items() if not k.startswith("_")}
            print(f"{name:8s} (--max-batch {max_batch}): {json.dumps(shown)}", flush=True)
    batched, serial = runs["batched"], runs["serial"]
    common = set(batched["_tokens"]) & set(serial["_tokens"])
    same = sum(batched["_tokens"][i] == serial["_tokens"][i] for i in common)
    summary = dict(
        requests=args.requests,
        clients=args.clients,
        max_tokens=args.max_tokens,
        answered_fraction=min(batched["answered_fraction"], serial["answered_fraction"]),
        batched_tokens_per_s=batched["tokens_per_s"],
        serial_tokens_per_s=serial["tokens_per_s"],
        batched_over_serial_tokens_per_s=round(batched["tokens_per_s"] / serial["tokens_per_s"], 2),
        batched_p50_p99_s=[batched["p50_latency_s"], batched["p99_latency_s"]],
        serial_p50_p99_s=[serial["p50_latency_s"], serial["p99_latency_s"]],
        largest_batch=batched["largest_batch"],
        same_tokens_fraction=round(same / len(common), 4) if common else None,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
