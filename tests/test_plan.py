"""The per-GPU memory plan (`mint plan`, mint.models.plan): its parameter counts against the published totals and a
real PEFT model, and the verdicts docs/scaling.md states."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mint.config import LoraConfig
from mint.models.lora import add_lora
from mint.models.plan import GiB, Job, lora_params, make_plan, param_counts, parse_bytes
from mint.models.shapes import SHAPES, RealShape, layer_config, shape
from mint.models.specs import tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key", sorted(SHAPES))
def test_parameter_counts_reproduce_the_published_totals(key):
    s = shape(key)
    total = sum(param_counts(s).values())
    assert total / 1e9 == pytest.approx(s.total_params_b, rel=0.005)


@pytest.mark.parametrize("key", sorted(SHAPES))
def test_parameter_counts_equal_a_built_layer(key):
    """One MoE layer of the real config, built on the meta device: attention, experts and the rest add up."""
    s = shape(key)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(layer_config(s, 1))
    built = sum(p.numel() for p in model.parameters())
    one_layer = RealShape(**{**s.__dict__, "layers": 1, "dense_layers": 0})
    assert sum(param_counts(one_layer).values()) == pytest.approx(built, rel=1e-3)


def test_lora_parameter_count_equals_peft():
    config = tiny_config("qwen3_moe", 97)
    base = AutoModelForCausalLM.from_config(config)
    model = add_lora(base.requires_grad_(False), LoraConfig(rank=8), seed=0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tiny = RealShape(
        "tiny",
        "qwen3_moe",
        hidden=64,
        layers=2,
        dense_layers=0,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=4,
        top_k=2,
        moe_intermediate=64,
        intermediate=128,
        shared_intermediate=0,
        vocab=97,
        total_params_b=0.0,
    )
    assert lora_params(tiny, 8) == trainable


def test_sizes_parse():
    assert parse_bytes("96GB") == 96 * GiB and parse_bytes("141GiB") == 141 * GiB and parse_bytes("512M") == 2**29


def test_30b_a3b_at_16k_prompts_and_4k_responses_fits_a_96gb_h20():
    """A long-context job: Qwen3-30B-A3B, LoRA r=32, G=8, P=16384, R=4096, exact mode, 4 learner ranks."""
    plan = make_plan(shape("qwen3_30b_a3b"), "qwen3_30b_a3b", Job(16384, 8, 4096, data_parallel=4), 96 * GiB)
    assert plan.fits, plan.table()
    assert plan.terms["frozen base weights"] / GiB == pytest.approx(61.0 / 1.0737, rel=0.02)  # 30.5e9 x 2 bytes


def test_mint_plan_cli_prints_the_table_and_the_verdict():
    cmd = [sys.executable, "-m", "mint.cli", "plan", "recipes/qwen3_30b_a3b_8xh20.toml", "--gpus", "4"]
    proc = subprocess.run(
        [*cmd, "--gpu-memory", "96GB", "--prompt-len", "16384"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "fits in 96 GiB" in proc.stdout and "prefix dK/dV" in proc.stdout
    small = subprocess.run(
        [*cmd, "--gpu-memory", "24GB", "--prompt-len", "16384"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert small.returncode == 1 and "does NOT fit" in small.stdout
