"""An INT4 frozen base in compressed-tensors' pack-quantized format (Kimi-K2.5's experts): the dequantizing matmul,
the checkpoint loader (Kimi-K2.5's released layout included) and what it refuses. LongStraw exact on it, against the
same weights dequantized, is tests/test_quant.py's parametrized test.

The format is read and written only by compressed-tensors itself (its compressor packs and unpacks); the reference
is the unquantized base with the decompressed weights put in, run by transformers' own modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_kimi_checkpoint import _ids, build_kimi_tiny
from test_quant import _dequantized_twin

from mint.config import load_config
from mint.errors import ConfigError
from mint.models.quant import ExpertWeight, is_quantized_experts
from mint.models.quant_checkpoint import checkpoint_quantization, pack_checkpoint, resolve_quantization
from mint.models.quant_int4 import PackedLinear, PackedWeight, compress, decompress, scheme_of
from mint.models.specs import load_model
from mint.models.tiny import ensure_tiny

TOL = dict(atol=2e-5, rtol=1e-4)


def _scheme(**weights):
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, **weights}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}  # fmt: skip
    return qc


@pytest.fixture(scope="module")
def int4_qwen(tmp_path_factory) -> tuple[str, str]:
    src = str(ensure_tiny("qwen3_moe"))
    return src, pack_checkpoint(src, str(tmp_path_factory.mktemp("int4") / "qwen3_moe-int4"))


def test_the_packed_matmul_equals_the_decompressed_one_and_saves_no_decompressed_weight():
    gen = torch.Generator().manual_seed(0)
    scheme = scheme_of(_scheme(), "test")
    parts = compress(torch.randn(48, 64, generator=gen), scheme)
    assert parts["weight_packed"].dtype == torch.int32 and parts["weight_packed"].shape == (48, 8)  # 8 nibbles a word
    assert parts["weight_scale"].shape == (48, 2)  # a scale per group of 32 inputs
    w = decompress(parts, scheme, torch.float32)
    assert len(torch.unique(torch.round(w / parts["weight_scale"].repeat_interleave(32, 1)))) <= 16  # 4-bit levels
    weight = PackedWeight({k: v for k, v in parts.items() if k != "weight_shape"}, (48, 64), scheme)
    x = torch.randn(5, 64, generator=gen, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = weight.linear(x)
    want = F.linear(x_ref, w)
    grad = torch.randn(5, 48, generator=gen)
    out.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    assert not any(t.shape == w.shape for t in saved), [t.shape for t in saved]  # no [48, 64] weight kept


def test_an_int4_checkpoint_keeps_its_experts_packed_and_matches_the_dequantized_base(int4_qwen):
    src, path = int4_qwen
    assert checkpoint_quantization(path) == "int4" and resolve_quantization("auto", path) == "int4"
    model = load_model(path, "float32")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert is_quantized_experts(experts) and experts.gate_up_proj.dtype == torch.int32
        assert ExpertWeight(experts, "gate_up_proj").shape == (4, 128, 64)  # E, 2I, H as the float experts
        assert type(layer.self_attn.q_proj) is torch.nn.Linear  # Kimi's scheme keeps attention unquantized
    plain = load_model(src, "float32")
    packed_bytes = sum(t.numel() * t.element_size() for t in model.model.layers[0].mlp.experts.parameters())
    plain_bytes = sum(t.numel() * t.element_size() for t in plain.model.layers[0].mlp.experts.parameters())
    assert packed_bytes * 8 == plain_bytes  # half a byte a weight against fp32's four (the scales are buffers)
    twin = _dequantized_twin(model, src)
    tokens = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, twin(tokens).logits, **TOL)
        assert (model(tokens).logits - plain(tokens).logits).abs().max() > 1e-3  # the 4-bit weights are in use


def test_kimi_k25_released_layout_with_int4_experts_loads_as_its_text_model(tmp_path):
    """The released Kimi-K2.5 layout (language_model.model.layers.*, a vision tower beside it) with its routed experts
    pack-quantized: the text model loads with packed experts, the vision weights are not read, and its logits are the
    dequantized text model's."""
    src = build_kimi_tiny(tmp_path / "kimi", "released")
    path = pack_checkpoint(src, str(tmp_path / "kimi-int4"))
    config = json.loads(Path(path, "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and config["quantization_config"]["format"] == "pack-quantized"
    model = load_model(path, "float32")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    moe = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert moe and all(e.gate_up_proj.dtype == torch.int32 for e in moe)
    assert not any("vision" in n for n, _ in model.named_parameters())
    twin = _dequantized_twin(model, src)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, twin(_ids()).logits, **TOL)


def test_a_packed_linear_takes_lora_and_passes_the_input_gradient():
    """A dense linear shipped pack-quantized (a W4A16 model quantizes them all): PEFT wraps it as an nn.Linear, the
    LoRA factors are in the compute dtype, and the input gradient is the decompressed matmul's."""
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(1)
    scheme = scheme_of(_scheme(), "test")
    parts = compress(torch.randn(32, 64, generator=gen), scheme)
    linear = PackedLinear(parts["weight_packed"], parts["weight_scale"], (32, 64), scheme, None, torch.float32)
    model = get_peft_model(torch.nn.Sequential(linear), LoraConfig(r=4, target_modules=["0"]))
    lora_a = next(p for n, p in model.named_parameters() if "lora_A" in n)
    assert lora_a.dtype == torch.float32 and lora_a.requires_grad
    x = torch.randn(3, 64, generator=gen, requires_grad=True)
    model(x).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    F.linear(x_ref, decompress(parts, scheme, torch.float32)).sum().backward()
    # With lora_B at zero (PEFT's init) the LoRA adds nothing to dX: it is the frozen weight's alone.
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    assert lora_a.grad is not None


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"symmetric": False}, "symmetric"),
        ({"num_bits": 8}, "int8; Mint reads 4-bit"),
        ({"type": "float", "num_bits": 8}, "weight-only symmetric INT"),
        ({"strategy": "channel", "group_size": None}, "symmetric INT groups"),
    ],
)
def test_an_int4_scheme_mint_does_not_read_is_refused_in_one_line(int4_qwen, tmp_path, weights, message):
    _, path = int4_qwen
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in Path(path).iterdir():
        (changed / f.name).symlink_to(f)
    (changed / "config.json").unlink()
    config = json.loads(Path(path, "config.json").read_text())
    config["quantization_config"] = _scheme(**weights)
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as err:
        load_model(str(changed))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_an_int4_tiny_base_learns_the_smoke_task(int4_qwen, tmp_path):
    """The smoke recipe on tiny:qwen3_moe with its experts pack-quantized INT4, learner and built-in rollout engine
    both on the packed base: 100 steps took 0.31 -> 0.93 (bench/quant_learning.py --quantization int4 runs the
    hybrid and MLA bases too)."""
    from mint.train.driver import train

    overrides = [f"model.path={int4_qwen[1]}", "learner.num_ranks=1", "grpo.steps=100",
                 f"logging.root={tmp_path / 'runs'}", "logging.name=int4", "logging.progress=false"]  # fmt: skip
    summary = train(load_config("recipes/smoke.toml", overrides))
    assert summary["reward_gain"] >= 0.3, summary
