"""A million-entry revision catalog: build time, get-by-id and latest(run) latency, a 1000-deep lineage walk, and
revision bytes against a merged checkpoint.

The catalog holds `--runs` runs of `--steps` revisions each, every revision the child of the previous one (so each
run is a lineage chain `--steps` deep). Their entries are metadata only (ids are sha256 of run/step; the tensors are
not written), inserted through `Catalog.index_many`, the bulk path. A further `--real` revisions carry real tensors
(the LoRA of the embedded tiny Qwen3-MoE, r=8 on attention and experts, random values) written through
`Catalog.put`: hash, atomic directory write, fsync, index insert; and are read back through `Catalog.load`, which
re-hashes them.

revision_bytes_over_merged
    tiny_qwen3_moe      the real revision file against the tiny base's checkpoint (a merged checkpoint has the base's
                        shapes and dtype; the script also writes one with `export_merged` to check).
    qwen3_30b_a3b_r16   computed: LoRA r=16 on q/k/v/o and the routed experts (gate_up, down) of Qwen3-30B-A3B's
                        shapes (below), counted on a meta-device skeleton wrapped by PEFT, bf16 both sides.

    python bench/mint_catalog.py                    # 1,000,000 entries (about 1 GB of disk in a temp dir)
    python bench/mint_catalog.py --runs 10 --steps 1000 --real 8   # a quick look

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): the shapes the computed ratio assumes.
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    max_position_embeddings=40960,
)
RECIPE = __import__("hashlib").sha256(b"bench-recipe").hexdigest()
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs in the catalog")
    parser.add_argument("--steps", type=int, default=1000, help="revisions per run (= lineage depth)")
    parser.add_argument("--real", type=int, default=64, help="revisions with real tensors, written through put()")
    parser.add_argument("--queries", type=int, default=10000, help="timed get / latest calls each")
    parser.add_argument("--dir", default=None, help="where to build the catalog (default: a temp dir, removed)")
    parser.add_argument("--batch", type=int, default=100_000, help="entries per index transaction")
    return parser.parse_args()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 4)


def metadata_entries(runs: int, steps: int, lora_config: dict, fingerprint: str):
    """RevisionMeta for `runs` chains of `steps`, in publish order (step-major, as concurrent runs would interleave
    their publishes)."""
    from mint.hub.revisions import RevisionMeta

    recipe = RECIPE
    parents: list[str | None] = [None] * runs
    t0 = time.time() - runs * steps
    for step in range(steps):
        for r in range(runs):
            rid = hashlib.sha256(f"run{r:05d}/{step}".encode()).hexdigest()
            yield RevisionMeta(
                id=rid,
                run=f"run{r:05d}",
                step=step,
                parent=parents[r],
                created=t0 + step * runs + r,
                recipe_hash=recipe,
                base_model="Qwen/Qwen3-30B-A3B",
                base_fingerprint=fingerprint,
                lora_config=lora_config,
                metrics={"reward_mean": round(random.random(), 4), "loss": round(random.random(), 4)},
                nbytes=0,
                stored=False,
            )
            parents[r] = rid


def tiny_lora(base: str):
    from mint.config import LoraConfig
    from mint.models.lora import adapter_config_dict, add_lora, lora_state
    from mint.models.specs import load_model

    model = add_lora(load_model(base), LoraConfig(), seed=0)
    return lora_state(model), json.loads(json.dumps(adapter_config_dict(model, base)))


def main() -> None:
    args = parse_args()
    random.seed(0)
    from transformers import Qwen3MoeConfig

    from mint.hub.catalog import Catalog
    from mint.hub.export import checkpoint_bytes, export_merged, lora_size
    from mint.hub.revisions import base_fingerprint
    from mint.models.tiny import resolve_model_path

    base = resolve_model_path("tiny:qwen3_moe")  # built and cached on first use (~20 s), not part of the timings
    state, lora_config = tiny_lora(base)
    fingerprint = base_fingerprint(base)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mint-catalog-bench-"))
    try:
        cat = Catalog(root / "catalog")
        # ---- build ----
        t0 = time.perf_counter()
        batch, total = [], 0
        for meta in metadata_entries(args.runs, args.steps, lora_config, fingerprint):
            batch.append(meta)
            if len(batch) == args.batch:
                total += cat.index_many(batch)
                batch = []
        total += cat.index_many(batch)
        t_meta = time.perf_counter() - t0
        put_s, parent = [], None
        for i in range(args.real):
            tensors = {k: torch.randn_like(v) * 0.01 for k, v in state.items()}
            t = time.perf_counter()
            meta = cat.put(tensors, lora_config, run="real", step=i, parent=parent, base_fingerprint=fingerprint)
            put_s.append(time.perf_counter() - t)
            parent = meta.id
        build_s = time.perf_counter() - t0
        entries = cat.count()
        print(f"built {entries} entries in {build_s:.1f} s ({t_meta:.1f} s metadata)", file=sys.stderr)

        # ---- queries ----
        ids = [hashlib.sha256(f"run{random.randrange(args.runs):05d}/{random.randrange(args.steps)}".encode())
               .hexdigest() for _ in range(args.queries)]  # fmt: skip
        get_s = []
        for rid in ids:
            t = time.perf_counter()
            assert cat.get(rid).id == rid
            get_s.append(time.perf_counter() - t)
        runs = [f"run{random.randrange(args.runs):05d}" for _ in range(args.queries)]
        latest_s = []
        for run in runs:
            t = time.perf_counter()
            assert cat.latest(run).step == args.steps - 1
            latest_s.append(time.perf_counter() - t)
        lineage_s = []
        for run in runs[:20]:
            head = cat.latest(run).id
            t = time.perf_counter()
            chain = cat.lineage(head)
            lineage_s.append(time.perf_counter() - t)
            assert len(chain) == args.steps and chain[-1].step == 0
        load_s = []
        for meta in cat.list("real", limit=args.real):
            t = time.perf_counter()
            cat.load(meta.id)
            load_s.append(time.perf_counter() - t)

        # ---- sizes ----
        tiny_rev = cat.get(parent) if parent else cat.put(state, lora_config, run="real", step=0)
        merged_dir = root / "merged"
        export_merged(cat, tiny_rev.id, merged_dir, base)
        tiny_merged = checkpoint_bytes(base)
        assert checkpoint_bytes(merged_dir) == tiny_merged, "a merged checkpoint has the base's size"
        big = lora_size(Qwen3MoeConfig(**QWEN3_30B_A3B), 16, ATTENTION, target_experts=True)
        db_bytes = sum(f.stat().st_size for f in (root / "catalog").glob("catalog.sqlite*"))
        cat.close()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    result = {
        "entries": entries,
        "build_seconds": round(build_s, 2),
        "build_metadata_seconds": round(t_meta, 2),
        "get_p50_ms": ms(statistics.median(get_s)),
        "get_p99_ms": ms(pct(get_s, 0.99)),
        "latest_p50_ms": ms(statistics.median(latest_s)),
        "latest_p99_ms": ms(pct(latest_s, 0.99)),
        "lineage_1000_ms": ms(statistics.median(lineage_s)) if args.steps == 1000 else None,
        "lineage_depth": args.steps,
        "lineage_ms": ms(statistics.median(lineage_s)),
        "real_revisions": args.real,
        "put_p50_ms": ms(statistics.median(put_s)) if put_s else None,
        "load_verified_p50_ms": ms(statistics.median(load_s)) if load_s else None,
        "db_bytes": db_bytes,
        "revision_bytes_over_merged": {
            "tiny_qwen3_moe": round(tiny_rev.nbytes / tiny_merged, 4),
            "qwen3_30b_a3b_r16": round(big["lora_params"] / big["base_params"], 5),
        },
        "tiny_revision_bytes": tiny_rev.nbytes,
        "tiny_merged_bytes": tiny_merged,
        "qwen3_30b_a3b_r16": {
            "shapes": QWEN3_30B_A3B,
            "lora": "r=16 on q_proj, k_proj, v_proj, o_proj and the fused routed experts (gate_up_proj, down_proj)",
            "lora_params": big["lora_params"],
            "base_params": big["base_params"],
            "revision_bytes_bf16": big["lora_params"] * 2,
            "merged_bytes_bf16": big["base_params"] * 2,
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
