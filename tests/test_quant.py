"""An FP8 frozen base: the format, the dequantizing matmul, the checkpoint loader and LongStraw on it (LongStraw on
an INT4 base too: tests/test_quant_int4.py has the rest of that format).

The reference for every comparison is the same weights dequantized to fp32 and run by transformers' own modules (a
plain nn.Linear, the experts' own forward); for the shipped GQA base also transformers' own FP8 loader, which on CPU
dequantizes the checkpoint when it loads it.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import pop_lora_grads, update_inputs, update_objective
from transformers import AutoModelForCausalLM

from longstraw.engine import UpdateSpec, grpo_update
from mint.config import LoraConfig, load_config
from mint.errors import ConfigError
from mint.models.lora import add_lora
from mint.models.quant import (
    FP8,
    ExpertWeight,
    Fp8Linear,
    dequantize_fp8,
    fp8_linear,
    is_quantized_experts,
    quantize_fp8,
)
from mint.models.quant_checkpoint import pack_checkpoint, quantize_checkpoint, resolve_quantization
from mint.models.quant_int4 import PackedLinear
from mint.models.specs import load_model
from mint.models.tiny import ensure_tiny
from mint.train.preflight import preflight

BLOCK = (16, 16)
# One fp32 matmul of the same operands in another order: a few ulps of the largest term summed.
TOL = dict(atol=2e-5, rtol=1e-4)


def test_quantize_keeps_each_value_within_half_an_e4m3_step_of_its_block_scale():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 24, generator=gen) * torch.logspace(-3, 1, 24)  # columns of very different sizes
    q, scale = quantize_fp8(w, BLOCK)
    assert q.dtype == FP8 and scale.shape == (3, 3, 2)  # ceil(40/16) x ceil(24/16) blocks per matrix
    back = dequantize_fp8(q, scale, BLOCK, torch.float32)
    grid = scale.repeat_interleave(16, -2).repeat_interleave(16, -1)[:, :40, :24]
    # e4m3: 3 mantissa bits (relative step 2^-3 of a normal value), subnormal step 2^-9 in units of the scale.
    bound = 2.0**-4 * w.abs() + 2.0**-10 * grid
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    assert (q.float().abs().amax(dim=(-1, -2)) == 448).all()  # each matrix's largest value is the format's largest


def test_the_dequantizing_matmul_equals_the_dequantized_one_and_saves_no_dequantized_weight():
    gen = torch.Generator().manual_seed(1)
    q, scale = quantize_fp8(torch.randn(48, 32, generator=gen), BLOCK)
    bias = torch.randn(48, generator=gen)
    w = dequantize_fp8(q, scale, BLOCK, torch.float32)
    x = torch.randn(5, 32, generator=gen, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fp8_linear(x, q, scale, BLOCK, bias)
    want = F.linear(x_ref, w, bias)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    assert saved and all(t.dtype == FP8 or t.numel() == scale.numel() for t in saved), [t.dtype for t in saved]


def _fp8_tiny(family: str, tmp_path) -> tuple[str, str]:
    src = str(ensure_tiny(family))
    return src, quantize_checkpoint(src, str(tmp_path / f"{family}-fp8"), BLOCK)


def _int4_tiny(family: str, tmp_path) -> tuple[str, str]:
    src = str(ensure_tiny(family))
    return src, pack_checkpoint(src, str(tmp_path / f"{family}-int4"))


def _int4_linears_tiny(family: str, tmp_path) -> tuple[str, str]:
    """Every linear packed too (a W4A16 export), in groups of 16: the tiny widths are multiples of 16."""
    src = str(ensure_tiny(family))
    return src, pack_checkpoint(src, str(tmp_path / f"{family}-w4a16"), group_size=16, linears=True)


QUANTIZED_TINY = {"fp8": _fp8_tiny, "int4": _int4_tiny, "int4_linears": _int4_linears_tiny}


def _dequantized_twin(quantized: torch.nn.Module, src: str) -> torch.nn.Module:
    """The unquantized base of `src` with every quantized weight replaced by its dequantized fp32 value: the
    reference model, run by transformers' own modules."""
    twin = load_model(src, "float32")
    modules = dict(twin.named_modules())
    count = 0
    for name, module in quantized.named_modules():
        if isinstance(module, Fp8Linear | PackedLinear):
            modules[name].weight.data = module.dequantized(torch.float32)
            count += 1
        elif is_quantized_experts(module):
            for p in ("gate_up_proj", "down_proj"):
                w = ExpertWeight(module, p)
                if w.packed is not None:
                    value = torch.stack([w.packed.dequantized(torch.float32, e) for e in range(w.shape[0])])
                else:
                    value = dequantize_fp8(w.weight, w.scale, w.block, torch.float32)
                getattr(modules[name], p).data = value
            count += 1
    assert count
    return twin


def test_an_fp8_checkpoint_loads_quantized_and_matches_transformers_own_dequantizing_load(tmp_path):
    _, path = _fp8_tiny("qwen3_moe", tmp_path)
    config = json.loads(Path(path, "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == list(BLOCK)
    model = load_model(path, "float32")
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and layer.self_attn.q_proj.weight.dtype == FP8
    assert layer.mlp.experts.gate_up_proj.dtype == FP8 and not isinstance(model.lm_head, Fp8Linear)
    assert layer.mlp.gate.weight.dtype == torch.float32  # the router ships unquantized
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # transformers dequantizes on CPU
    assert type(reference.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    tokens = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, **TOL)
    fp8_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    ref_bytes = sum(t.numel() * t.element_size() for t in reference.parameters())
    assert fp8_bytes < 0.5 * ref_bytes  # the linears and experts take a byte a weight (plus scales), not four


@pytest.mark.parametrize("quantization", ["fp8", "int4", "int4_linears"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "deepseek_v3"])
def test_longstraw_exact_on_a_quantized_base_equals_the_dequantized_base(family, quantization, tmp_path):
    """GQA, hybrid and MLA: logprobs, LoRA gradients (attention and factored experts, every layer) and the input
    gradient of one exact LongStraw update on the FP8 base (every linear and expert quantized) or the INT4 one (its
    experts packed, as Kimi-K2.5 ships; or every linear packed too) equal those on the same weights dequantized to
    fp32."""
    src, path = QUANTIZED_TINY[quantization](family, tmp_path)
    runs = {}
    quantized = load_model(path, "float32")
    assert any(isinstance(m, PackedLinear) for m in quantized.modules()) == (quantization == "int4_linears")
    for label, base in (("reference", _dequantized_twin(quantized, src)), ("quantized", quantized)):
        model = add_lora(base, LoraConfig(), seed=0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        tokens_P, responses = update_inputs(model.config.vocab_size)
        logps = []

        def objective(i, logp_R, ref_logp_R, logps=logps):
            logps.append(logp_R.detach().clone())
            return update_objective(i, logp_R, ref_logp_R)

        grpo_update(model, tokens_P, responses, objective, UpdateSpec(mode="exact", chunk_size=7, need_ref=True))
        grads = pop_lora_grads(model)
        embeds = model.get_input_embeddings()(tokens_P[None]).detach().requires_grad_()
        model(inputs_embeds=embeds).logits[0, -1].logsumexp(-1).backward()
        runs[label] = (logps, grads, embeds.grad)
    logps, grads, input_grad = runs["quantized"]
    want_logps, want_grads, want_input_grad = runs["reference"]
    for got, want in zip(logps, want_logps, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert grads.keys() == want_grads.keys() and any("experts" in n for n in grads)
    assert any("layers.0." in n and g.abs().sum() > 0 for n, g in grads.items())  # reaches the first layer
    for name, want in want_grads.items():
        # 1e-5 of the tensor's largest entry (at least 1e-5): each entry sums hundreds of fp32 products, in another
        # order on the quantized base (measured worst: 1e-8 of the largest entry on FP8, 1e-6 on INT4).
        atol = 1e-5 * max(1.0, want.abs().max().item())
        torch.testing.assert_close(grads[name], want, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert input_grad.abs().sum() > 0
    torch.testing.assert_close(input_grad, want_input_grad, **TOL)


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_model_quantization_must_match_the_checkpoint_in_one_line(quantization, tmp_path):
    src, path = QUANTIZED_TINY[quantization]("qwen3_moe", tmp_path)
    kind, other = {"fp8": ("an FP8", "int4"), "int4": ("an INT4", "fp8")}[quantization]
    assert resolve_quantization("auto", path) == quantization and resolve_quantization("auto", src) == "none"
    assert resolve_quantization("none", "tiny:qwen3_moe") == "none"
    refusal = rf"^model.quantization: none, but .* is {kind} checkpoint; use auto or {quantization}$"
    with pytest.raises(ConfigError, match=refusal):
        load_model(path, "float32", "none")
    refusal = rf"^model.quantization: {quantization}, but .* is a plain checkpoint; use auto or none"
    with pytest.raises(ConfigError, match=refusal):
        load_model(src, "float32", quantization)
    overrides = [f"model.path={path}", f"model.quantization={other}", f"logging.root={tmp_path / 'runs'}"]
    with pytest.raises(ConfigError, match=rf"model\.quantization: {other}, but .* is {kind} checkpoint"):
        preflight(load_config("recipes/smoke.toml", overrides))
    assert preflight(load_config("recipes/smoke.toml", [*overrides[:1], overrides[2]])).model_path == path


def test_a_checkpoint_quantized_otherwise_is_refused_by_name(tmp_path):
    src = str(ensure_tiny("qwen3_moe"))
    path = quantize_checkpoint(src, str(tmp_path / "awq"), BLOCK)
    config_file = Path(path, "config.json")
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="is quantized as 'awq'"):
        load_model(path)
    assert glob.glob(f"{src}/*.safetensors")  # the source base is untouched


def test_an_adapter_is_never_merged_into_an_fp8_base(tmp_path):
    from mint.errors import MintError
    from mint.hub.export import merged_model

    _, path = _fp8_tiny("qwen3_moe", tmp_path)
    with pytest.raises(MintError, match="never merges into a quantized base"):
        merged_model({}, {}, path)


def test_quantizing_a_loaded_model_gives_the_bytes_a_quantized_checkpoint_loads(tmp_path):
    from mint.models.quant_checkpoint import quantize_model

    src, path = _fp8_tiny("qwen2_moe", tmp_path)  # shared experts and q/k/v biases too
    loaded = load_model(path, "float32")
    converted = quantize_model(load_model(src, "float32"), BLOCK)
    want = dict(loaded.state_dict())
    got = dict(converted.state_dict())
    assert got.keys() == want.keys() and any(t.dtype == FP8 for t in got.values())
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        bits = (got[name].view(torch.uint8), t.view(torch.uint8)) if t.dtype == FP8 else (got[name], t)
        assert torch.equal(*bits), name


@pytest.mark.slow
def test_an_fp8_tiny_base_learns_the_smoke_task(tmp_path):
    """The smoke recipe on the FP8 copy of tiny:qwen3_moe, learner and built-in rollout engine both on the FP8 base:
    100 steps take 0.31 -> 0.93 here (bench/quant_learning.py runs the hybrid and MLA bases too)."""
    from mint.train.driver import train

    _, path = _fp8_tiny("qwen3_moe", tmp_path)
    overrides = [f"model.path={path}", "learner.num_ranks=1", "grpo.steps=100", f"logging.root={tmp_path / 'runs'}",
                 "logging.name=fp8", "logging.progress=false"]  # fmt: skip
    summary = train(load_config("recipes/smoke.toml", overrides))
    assert summary["reward_gain"] >= 0.3, summary
