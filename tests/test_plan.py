"""The per-GPU memory plan (`mint plan`, mint.models.plan): its parameter counts against the published totals and a
real PEFT model, the verdicts docs/scaling.md states, the hybrid shapes' prompt-state terms (K/V of the full layers,
boundary state of the linear layers, exact mode's state checkpoints and gradients) and the MLA shapes' (latent pages,
their fp32 gradient, DSA indexer pages and the optional indexer-replay record)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mint.config import LoraConfig
from mint.models.lora import add_lora
from mint.models.plan import (
    MEASURED,
    GiB,
    Job,
    lora_params,
    make_plan,
    mla_lora_modules,
    param_counts,
    parse_bytes,
    state_checkpoints,
    weight_bytes,
)
from mint.models.shapes import SHAPES, RealShape, layer_config, shape
from mint.models.specs import tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key", sorted(SHAPES))
def test_parameter_counts_reproduce_the_published_totals(key):
    s = shape(key)
    total = sum(param_counts(s).values()) / 1e9
    if s.hybrid:
        # Their cards give whole billions (+-0.5 B), and the Qwen3.5 ones count the vision tower (about 0.45 B) that
        # the text model does not load. A wrong width still shows: 397B-A17B with a 4096-wide shared expert is 398.6.
        assert s.total_params_b - 1.0 <= total <= s.total_params_b + 0.5
    elif s.params_rounding_b:
        # A rounded headline (GLM-4.7-Flash "30B", GLM-5 "744B", Kimi-K2.5 "1T"): within half its rounding unit.
        assert abs(total - s.total_params_b) <= s.params_rounding_b / 2
    else:
        assert total == pytest.approx(s.total_params_b, rel=0.005)


@pytest.mark.parametrize("key", sorted(SHAPES))
def test_parameter_counts_equal_a_built_layer(key):
    """One MoE layer of the real config (a hybrid: its 4-layer block, 3 Gated DeltaNet + 1 gated full attention; a DSA
    shape: an MLA layer with its indexer), built on the meta device from transformers' own classes: attention,
    experts and the rest add up."""
    s = shape(key)
    n = 4 if s.hybrid else 1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(layer_config(s, n))
    built = sum(p.numel() for p in model.parameters())
    block = RealShape(**{**s.__dict__, "layers": n, "dense_layers": 0, "indexer_layers": n if s.dsa else 0})
    assert sum(param_counts(block).values()) == pytest.approx(built, rel=1e-3)


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


def test_hybrid_lora_parameter_count_equals_peft():
    """A hybrid's default LoRA: q (query + output gate), k, v, o of the full layer only, and the fused experts."""
    tiny = RealShape(
        "tiny-hybrid",
        "qwen3_5_moe",
        hidden=64,
        layers=4,
        dense_layers=0,
        heads=4,
        kv_heads=2,
        head_dim=32,
        experts=4,
        top_k=2,
        moe_intermediate=64,
        intermediate=0,
        shared_intermediate=64,
        vocab=97,
        total_params_b=0.0,
        full_attention_interval=4,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel=4,
        attn_output_gate=True,
        shared_expert_gate=True,
    )
    base = AutoModelForCausalLM.from_config(layer_config(tiny, 4))
    model = add_lora(base.requires_grad_(False), LoraConfig(rank=8), seed=0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(tiny, 8) == trainable


def test_35b_a3b_prompt_state_terms_match_the_hand_figures():
    """Qwen3.5-35B-A3B: a 61.4 MiB boundary state per sequence (30 x (S 32x128x128 fp32 + 3 conv rows of 8192 bf16
    channels)), 20 KiB of K/V per prompt token (10 full layers x 2 x 2 heads x 256 x bf16) and 31 state checkpoints
    (1.86 GiB) at P=128k with C=4096."""
    s = shape("qwen35_35b_a3b")
    assert (s.full_layers, s.linear_layers, s.conv_dim) == (10, 30, 8192)
    assert s.boundary_state_bytes(2) == 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    assert s.boundary_state_bytes(2) / 2**20 == pytest.approx(61, abs=0.5)
    assert s.kv_bytes_per_token(2) == 20 * 1024
    plan = make_plan(s, "qwen35_35b_a3b", Job(131072, 8, 4096, chunk=4096), 96 * GiB)
    assert plan.terms["state checkpoints (31 x boundary state, C=4096)"] / GiB == pytest.approx(1.9, abs=0.05)
    assert plan.terms["prefix K/V (10 full layers)"] == 131072 * 20 * 1024
    assert plan.terms["boundary-state gradients (2 x fp32)"] == 2 * 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 4)


@pytest.mark.parametrize("key", ["qwen35_35b_a3b", "qwen35_122b_a10b"])
def test_hybrid_state_arithmetic_equals_the_captured_tensors(key):
    """The boundary state and K/V bytes `mint plan` computes from the dims equal what bench/real_shapes.py read off
    a real capture at those dims (transformers' cache after a P-token prompt: S, the conv window, K and V)."""
    s = shape(key)
    m = json.loads((MEASURED / f"{key}.json").read_text())["per_layer"]
    assert s.linear_layers * m["boundary_state_bytes_per_linear_layer"] == s.boundary_state_bytes(2)
    assert s.full_layers * m["kv_bytes_per_token_full_layer"] == s.kv_bytes_per_token(2)


def _hybrid_terms(plan, prefix):
    return [v for k, v in plan.terms.items() if k.startswith(prefix)]


def test_hybrid_boundary_state_is_flat_in_p_and_kv_grows_with_it():
    s = shape("qwen35_35b_a3b")
    plans = [make_plan(s, "qwen35_35b_a3b", Job(p, 8, 4096, chunk=4096), 96 * GiB) for p in (16384, 262144)]
    (b16,), (b256,) = (_hybrid_terms(p, "boundary state") for p in plans)
    (kv16,), (kv256,) = (_hybrid_terms(p, "prefix K/V") for p in plans)
    (d16,), (d256,) = (_hybrid_terms(p, "prefix dK/dV") for p in plans)
    assert b16 == b256 == s.boundary_state_bytes(2)
    assert kv256 == 16 * kv16 and d256 == 16 * d16 == 2 * 16 * kv16


def test_state_checkpoints_scale_with_p_over_c():
    # The capture covers P - 1 positions (the last prompt token starts each replay): ceil((P - 1) / C) chunks.
    assert [state_checkpoints(p, 4096) for p in (1, 4097, 4098, 8193, 8194)] == [0, 0, 1, 1, 2]
    s = shape("qwen35_35b_a3b")
    for p, c in [(131072, 4096), (262144, 4096), (131072, 8192), (131072, 1024), (100_000, 3000)]:
        plan = make_plan(s, "qwen35_35b_a3b", Job(p, 8, 4096, chunk=c), 96 * GiB)
        (term,) = _hybrid_terms(plan, "state checkpoints")
        assert term == (math.ceil((p - 1) / c) - 1) * s.boundary_state_bytes(2)
    half = make_plan(s, "qwen35_35b_a3b", Job(131072, 8, 4096, chunk=8192), 96 * GiB)
    double = make_plan(s, "qwen35_35b_a3b", Job(262144, 8, 4096, chunk=4096), 96 * GiB)
    assert _hybrid_terms(half, "state checkpoints")[0] / s.boundary_state_bytes(2) == 15
    assert _hybrid_terms(double, "state checkpoints")[0] / s.boundary_state_bytes(2) == 63


def test_detached_hybrid_keeps_only_the_final_boundary_state():
    s = shape("qwen35_35b_a3b")
    plan = make_plan(s, "qwen35_35b_a3b", Job(131072, 8, 4096, chunk=4096, mode="detached"), 96 * GiB)
    assert not _hybrid_terms(plan, "state checkpoints") and not _hybrid_terms(plan, "boundary-state gradients")
    assert not _hybrid_terms(plan, "prefix dK/dV") and _hybrid_terms(plan, "boundary state") == [
        s.boundary_state_bytes(2)
    ]


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


@pytest.mark.parametrize(
    ("layout", "refusal"),
    [
        (
            ["--gpus", "8", "--expert-parallel", "8", "--context-parallel", "2"],
            "longstraw.context_parallel: 2 x learner.expert_parallel 8 = 16 does not divide learner.num_ranks = 8",
        ),
        (["--gpus", "6", "--expert-parallel", "6"], "6 does not divide the base's experts (128 routed"),
        (["--gpus", "8", "--expert-parallel", "3"], "learner.expert_parallel: 3 does not divide learner.num_ranks"),
        (["longstraw.mode=resident", "--gpus", "2", "--context-parallel", "2"], "in exact or detached mode"),
    ],
)
def test_mint_plan_refuses_a_layout_the_learner_refuses(layout, refusal, monkeypatch, capsys):
    """A plan that says "fits" for EP x CP = 16 on 8 GPUs describes a run `mint train` would not start: the layout
    goes through the learner's own rules and fails in one line, with no table."""
    from mint.cli import main

    monkeypatch.chdir(ROOT)
    rc = main(["plan", "recipes/qwen3_30b_a3b_8xh20.toml", *layout, "--prompt-len", "16384"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("mint: config error: ") and refusal in err and err.count("\n") == 1, err


def test_mint_plan_takes_the_layout_from_the_recipe_unless_a_flag_sets_it(monkeypatch, capsys):
    """The 122B recipe asks for 4 learner ranks with EP=4: the plan counts that layout by default, and the flags
    override it."""
    from mint.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["plan", "recipes/qwen35_122b_a10b_8xh20.toml", "--prompt-len", "16384"]) == 0
    assert "DP=4, EP=4, CP=1" in capsys.readouterr().out.splitlines()[0]
    flags = ["--prompt-len", "16384", "--gpus", "8", "--expert-parallel", "1"]
    assert main(["plan", "recipes/qwen35_122b_a10b_8xh20.toml", *flags]) in (0, 1)  # 1: the whole experts may not fit
    assert "DP=8, EP=1, CP=1" in capsys.readouterr().out.splitlines()[0]


def test_mint_plan_on_the_qwen35_35b_a3b_recipe_fits_and_shows_every_hybrid_term():
    cmd = [sys.executable, "-m", "mint.cli", "plan", "recipes/qwen35_35b_a3b_8xh20.toml", "--gpus", "4"]
    proc = subprocess.run(
        [*cmd, "--gpu-memory", "96GB", "--prompt-len", "16384"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "Qwen3.5-35B-A3B" in proc.stdout and "fits in 96 GiB" in proc.stdout
    for term in (
        "frozen base weights",
        "LoRA + grads + AdamW",
        "prefix K/V (10 full layers)",
        "boundary state (30 linear layers)",
        "prefix dK/dV (fp32, 10 full layers)",
        "state checkpoints (",
        "boundary-state gradients (2 x fp32)",
        "prompt-backward chunk graph",
        "replay graph",
        "working buffers",
    ):
        assert term in proc.stdout, term


def test_qwen35_122b_a10b_recipe_fits_4_learner_h20s_only_with_experts_split():
    """The 122B-A10B recipe's layout: 4 learner ranks with EP=4 fit at P=16384; without EP the base alone does not."""
    s, key = shape("qwen35_122b_a10b"), "qwen35_122b_a10b"
    job = Job(16384, 8, 4096, chunk=4096, data_parallel=4, expert_parallel=4)
    assert make_plan(s, key, job, 96 * GiB).fits
    assert not make_plan(s, key, Job(16384, 8, 4096, chunk=4096, data_parallel=4), 96 * GiB).fits


def _tiny_mla(family: str) -> RealShape:
    dsa = family in ("glm_moe_dsa", "deepseek_v32")
    return RealShape(
        f"tiny-{family}",
        family,
        hidden=64,
        layers=2,
        dense_layers=0,
        heads=4,
        kv_heads=4,
        head_dim=24,
        experts=4,
        top_k=2,
        moe_intermediate=32,
        intermediate=96,
        shared_intermediate=32,
        vocab=97,
        total_params_b=0.0,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_heads=2 if dsa else 0,
        index_head_dim=16 if dsa else 0,
        index_topk=8 if dsa else 0,
        indexer_layers=2 if dsa else 0,
    )


@pytest.mark.parametrize("family", ["glm4_moe_lite", "glm_moe_dsa", "deepseek_v3", "deepseek_v32"])
def test_mla_parameter_and_lora_counts_equal_a_built_peft_model(family):
    """An MLA model's parameters (with its DSA indexers) and its LoRA on the MLA recipe's targets (q_a/q_b,
    kv_a_proj_with_mqa, kv_b_proj, o_proj, the fused experts; nothing on the indexer), against transformers + PEFT."""
    tiny = _tiny_mla(family)
    base = AutoModelForCausalLM.from_config(layer_config(tiny, 2))
    norms = (2 * tiny.layers + 1) * tiny.hidden  # the decoder's RMSNorms, which param_counts leaves out
    assert sum(p.numel() for p in base.parameters()) - norms == sum(param_counts(tiny).values())
    lora = LoraConfig(rank=8, target_modules=list(mla_lora_modules(tiny)))
    model = add_lora(base.requires_grad_(False), lora, seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not [n for n in trainable if "indexer" in n]
    assert lora_params(tiny, 8) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_glm5_mla_terms_match_the_hand_figures():
    """GLM-5 at P=128k, G=2, R=4096, CP=2: latent pages 78 x (512 + 64) x bf16 = 87.75 KiB per token, their fp32
    gradient twice that, indexer pages 78 x 128 x bf16 = 19.5 KiB per token (no gradient), and the indexer-replay record
    2 x 4096 x 78 x 2048 x int32 = 4.88 GiB, 0 while off."""
    s, P = shape("glm5"), 131072
    assert s.latent_bytes_per_token(2) == 78 * 576 * 2 == 89856
    assert s.indexer_bytes_per_token(2) == 78 * 128 * 2
    job = Job(P, 2, 4096, context_parallel=2)
    plan = make_plan(s, "glm5", job, 96 * GiB)
    assert plan.terms["prefix latent pages (78 layers x 576)"] == P * 89856 / 2
    assert plan.terms["prefix dLatent (fp32, 78 layers)"] == 2 * P * 89856 / 2
    assert plan.terms["indexer pages (78 layers x 128, no gradient)"] == P * 78 * 128 * 2 / 2
    assert plan.terms["indexer replay record (off)"] == 0
    on = make_plan(s, "glm5", Job(P, 2, 4096, context_parallel=2, indexer_replay=True), 96 * GiB)
    assert on.terms["indexer replay record (on)"] == 2 * 4096 * 78 * 2048 * 4
    assert on.terms["indexer replay record (on)"] / GiB == pytest.approx(4.875)
    assert on.total - plan.total == 2 * 4096 * 78 * 2048 * 4
    detached = make_plan(s, "glm5", Job(P, 2, 4096, mode="detached"), 96 * GiB)
    assert not _hybrid_terms(detached, "prefix dLatent") and _hybrid_terms(detached, "indexer pages")


def test_glm5_latent_pages_are_over_30x_below_expanded_kv():
    """The latent term against what expanded per-head K/V (64 heads x (192 + 64 + 256)) would hold: 56.9x at GLM-5,
    in the plan's arithmetic and as measured on the tensors the module caches and expands (bench/real_shapes.py)."""
    s, P = shape("glm5"), 131072
    latent = make_plan(s, "glm5", Job(P, 2, 4096), 96 * GiB).terms["prefix latent pages (78 layers x 576)"]
    expanded = P * s.expanded_kv_bytes_per_token(2)
    assert expanded == P * 78 * 64 * 512 * 2
    assert expanded / latent >= 30 and expanded / latent == pytest.approx(512 * 64 / 576)
    m = json.loads((MEASURED / "glm5.json").read_text())
    assert m["expanded_over_latent_prefix_bytes"] >= 30
    assert m["expanded_over_latent_prefix_bytes"] == pytest.approx(expanded / latent)
    per_layer = m["per_layer"]
    assert s.layers * per_layer["latent_bytes_per_token_layer"] == s.latent_bytes_per_token(2)
    assert s.indexer_layers * per_layer["indexer_bytes_per_token_layer"] == s.indexer_bytes_per_token(2)


def test_mint_plan_on_the_glm47_flash_recipe_fits_and_shows_every_mla_term():
    cmd = [sys.executable, "-m", "mint.cli", "plan", "recipes/glm47_flash_8xh20.toml", "--gpus", "4"]
    proc = subprocess.run(
        [*cmd, "--gpu-memory", "96GB", "--prompt-len", "16384"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "GLM-4.7-Flash" in proc.stdout and "fits in 96 GiB" in proc.stdout
    for term in (
        "frozen base weights",
        "LoRA + grads + AdamW",
        "prefix latent pages (47 layers x 576)",
        "prefix dLatent (fp32, 47 layers)",
        "prompt-backward chunk graph",
        "replay graph",
        "working buffers",
        "expanded K/V would be",
    ):
        assert term in proc.stdout, term
    assert "indexer" not in proc.stdout  # GLM-4.7-Flash has no DSA indexer


@pytest.mark.parametrize("replay", ["true", "false"])
def test_mint_plan_counts_the_indexer_replay_records_the_recipe_asks_for(replay):
    """grpo.indexer_replay in the recipe (here an override) decides whether mint plan counts the records."""
    cmd = [sys.executable, "-m", "mint.cli", "plan", "recipes/glm47_flash_8xh20.toml", "model.path=zai-org/GLM-5"]
    args = ["--gpus", "32", "--expert-parallel", "32", "--gpu-memory", "96GB", "--prompt-len", "4096"]
    proc = subprocess.run(
        [*cmd, f"grpo.indexer_replay={replay}", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: does not fit (the bf16 base of GLM-5 on 32 GPUs)
    line = next(line for line in proc.stdout.splitlines() if "indexer replay record" in line)
    assert ("(on)" in line) == (replay == "true"), line


@pytest.mark.parametrize(
    "recipe, shape_key",
    [("recipes/glm5_fp8_32xh20.toml", "glm5"), ("recipes/qwen35_397b_a17b_fp8_16xh20.toml", "qwen35_397b_a17b")],
)
def test_the_fp8_recipes_fit_their_learner_gpus_at_131072_tokens_and_bf16_does_not(recipe, shape_key, capsys):
    """GLM-5 on 32 H20 and Qwen3.5-397B-A17B on 8 learner H20s, P = 131,072, G = 8, R = 4,096: with the FP8 base the
    plan fits (every term shown); the same recipe with a bf16 base does not fit at any P."""
    from mint.cli import main

    args = ["--gpu-memory", "96GB", "--prompt-len", "131072"]
    assert main(["plan", recipe, *args]) == 0
    fp8 = capsys.readouterr().out
    assert "frozen base weights (FP8 + block scales)" in fp8 and "FP8 dequantize transient" in fp8 and "fits" in fp8
    assert main(["plan", recipe, "model.quantization=none", *args]) == 1
    assert "P = 0" in capsys.readouterr().out
    # The base term: attention, experts and dense MLPs at a byte and a 128 x 128 block's scale, the rest in bf16.
    counts, s = param_counts(shape(shape_key)), shape(shape_key)
    job = Job(prompt_len=131072, group=8, response_len=4096, expert_parallel=8)
    bf16, fp8_bytes = weight_bytes(s, job), weight_bytes(s, dataclasses.replace(job, quantization="fp8"))
    quantized = counts["attention"] + counts["experts"] / 8 + counts["shared_dense"]
    assert fp8_bytes == pytest.approx(bf16 - quantized * (2 - 1 - 4 / 128**2))
    assert bf16 / fp8_bytes > 1.9


def test_kimi_k25_fits_32_learner_gpus_with_int4_experts_and_not_in_bf16(capsys):
    """Kimi-K2.5 (1.04T, MLA, 384 experts) on 32 H20 with EP = 32, P = 131,072, G = 8, R = 4,096 (the GLM-5 recipe's
    layout, at Kimi's shape): with its experts INT4 as released the plan fits in exact and detached mode; in bf16 it
    fits in neither. The base term counts the experts at half a byte plus a bf16 scale per 32, the rest in bf16."""
    from mint.cli import main

    args = ["--shape", "kimi_k25", "--gpu-memory", "96GB", "--prompt-len", "131072"]
    recipe = "recipes/glm5_fp8_32xh20.toml"
    for mode in ("exact", "detached"):
        assert main(["plan", recipe, "model.quantization=int4", f"longstraw.mode={mode}", *args]) == 0
        out = capsys.readouterr().out
        assert "frozen base weights (INT4 experts + group scales)" in out and "INT4 dequantize transient" in out
        assert main(["plan", recipe, "model.quantization=none", f"longstraw.mode={mode}", *args]) == 1
        assert "P = 0" in capsys.readouterr().out
    s = shape("kimi_k25")
    counts = param_counts(s)
    job = Job(prompt_len=131072, group=8, response_len=4096, expert_parallel=32)
    bf16, int4 = weight_bytes(s, job), weight_bytes(s, dataclasses.replace(job, quantization="int4"))
    assert int4 == pytest.approx(bf16 - counts["experts"] / 32 * (2 - 0.5 - 2 / 32))
