"""Factored expert LoRA against PEFT's materialized W + s·B A path (fp32, CPU).

Two models per case from the same saved tiny base and the same seed: `add_lora(..., factored_experts=False)` is PEFT's
own forward, `add_lora(...)` the factored default. LoRA on attention and on the fused experts, non-zero lora_B.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_random_tiny, load_fp32
from peft.tuners.lora.layer import ParamWrapper

import mint_kernels
from longstraw.routing import RouteReplay, find_routers
from mint.config import LoraConfig
from mint.errors import ConfigError
from mint.models.expert_lora import experts_forward, factor_experts, is_factored
from mint.models.lora import add_lora, load_lora_state, lora_state
from mint.models.specs import moe_layers

FAMILIES = ["qwen3_moe", "qwen2_moe", "glm4_moe"]
HYBRID = ["qwen3_5_moe_text", "qwen3_next"]  # Gated DeltaNet + gated attention, routed experts beside a shared expert
# Multi-head latent attention with a dense first layer and V3-style routing (tiny_config: 3 layers, 4 routed experts
# beside a shared one); LoRA on every MLA projection, as the MLA recipes put it.
MLA = ["deepseek_v3", "glm4_moe_lite"]
MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
IMPLEMENTATIONS = ["grouped_mm", "eager"]  # transformers' default for these models, and the plain loop
ATOL, RTOL = 1e-5, 1e-4


# model_type -> the embedded tiny family of that architecture (mint.models.specs.tiny_config): 3 Gated DeltaNet
# layers then 1 gated full-attention layer, and for the MoE families 4 routed experts (top-2) beside a shared expert.
TINY_OF = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5"}


def build_hybrid_tiny(model_type: str, directory: str, vocab_size: int = 97, seed: int = 0) -> str:
    """Save a random tiny hybrid base of `model_type` (init std 0.05, as `build_random_tiny`) and return it."""
    return build_random_tiny(TINY_OF[model_type], directory, vocab_size, seed)


@pytest.fixture(scope="module", params=FAMILIES + HYBRID + MLA)
def base_path(request, tmp_path_factory) -> str:
    """The embedded tiny bases (mint.models.specs.tiny_config); glm4_moe is GLM-4.5-style: a dense first layer, sigmoid
    group-limited routing with routed_scaling_factor, and experts laid out as Qwen's. The hybrid families are built
    by their embedded tiny configs (`build_hybrid_tiny`), the MLA ones by `build_random_tiny` too."""
    directory = str(tmp_path_factory.mktemp(f"expert_lora_{request.param}"))
    build = build_hybrid_tiny if request.param in HYBRID else build_random_tiny
    return build(request.param, directory)


def _lora(config) -> LoraConfig:
    """The recipe default (attention projections and experts); on MLA its projections' names."""
    return LoraConfig(target_modules=MLA_TARGETS) if config.model_type in MLA else LoraConfig()


def _pair(path: str, implementation: str = "grouped_mm"):
    """(materialized, factored): the same base and seed, lora_B set to the same non-zero values in both."""
    models = []
    for factored in (False, True):
        base = load_fp32(path)
        base.set_experts_implementation(implementation)
        for p in base.parameters():
            p.requires_grad_(False)
        models.append(add_lora(base, _lora(base.config), seed=0, factored_experts=factored))
    state = lora_state(models[0])
    gen = torch.Generator().manual_seed(3)
    for name in sorted(state):
        if "lora_B" in name:  # PEFT starts B at zero, which would make LoRA a no-op on the forward
            state[name] = torch.randn(state[name].shape, generator=gen) * 0.05
    for model in models:
        load_lora_state(model, state)
    return models


def _ids(vocab: int, batch: int = 2, seq: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _expert_wrappers(model) -> list[ParamWrapper]:
    return [m for m in model.modules() if isinstance(m, ParamWrapper) and isinstance(m.base_layer, ParamWrapper)]


def test_add_lora_installs_the_factored_forward_on_every_experts_module(base_path):
    materialized, factored = _pair(base_path)
    outer = _expert_wrappers(factored)
    assert outer and all(is_factored(m) for m in outer)
    assert not any(is_factored(m) for m in _expert_wrappers(materialized))
    assert factor_experts(factored) == len(outer)  # idempotent
    for m in outer:  # PEFT's structure is untouched: ParamWrapper(ParamWrapper(<Family>Experts))
        assert type(m.base_layer.base_layer).__name__.endswith("Experts")
    # one per MoE layer and none on a dense one (GLM's and the MLA families' first layer)
    layers = sorted(int(n.split("layers.")[1].split(".")[0]) for n, m in factored.named_modules() if m in outer)
    assert layers == moe_layers(factored.config)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_logits_equal_materialized(base_path, implementation):
    materialized, factored = _pair(base_path, implementation)
    ids = _ids(materialized.config.vocab_size)
    with torch.no_grad():
        expected = materialized(ids).logits
        got = factored(ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_lora_b_is_bit_identical_to_the_base(base_path, implementation, dtype):
    """With B = 0 (a fresh adapter) the factored model is the base model bit for bit, as PEFT's W + 0 is: the trainer
    relies on the KL to the reference (adapter disabled) being exactly 0 before the first update."""
    base = load_fp32(base_path).to(dtype)
    base.set_experts_implementation(implementation)
    model = add_lora(base, _lora(base.config), seed=0)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        adapted = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    assert torch.equal(adapted, plain)


def test_factored_path_runs_the_kernel_and_never_peft_parametrization(base_path, monkeypatch):
    """The factored model calls mint_kernels.expert_lora twice per MoE layer and never PEFT's _activate_lora
    on an expert wrapper (which is where W + s·B A is formed)."""
    _, factored = _pair(base_path)
    calls = {"kernel": 0, "activate": 0}
    kernel = mint_kernels.expert_lora

    def counting_kernel(*args, **kwargs):
        calls["kernel"] += 1
        return kernel(*args, **kwargs)

    activate = ParamWrapper._activate_lora

    def counting_activate(self, *args, **kwargs):
        calls["activate"] += 1
        return activate(self, *args, **kwargs)

    monkeypatch.setattr(mint_kernels, "expert_lora", counting_kernel)
    monkeypatch.setattr(ParamWrapper, "_activate_lora", counting_activate)
    factored(_ids(factored.config.vocab_size)).logits.sum().backward()
    assert calls == {"kernel": 2 * len(_expert_wrappers(factored)), "activate": 0}


def test_every_lora_gradient_equals_materialized(base_path):
    materialized, factored = _pair(base_path)
    ids = _ids(materialized.config.vocab_size)
    target = torch.randn(*ids.shape, materialized.config.vocab_size, generator=torch.Generator().manual_seed(2))
    grads = []
    for model in (materialized, factored):
        (model(ids).logits * target).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    assert any("experts" in n and "lora_A" in n for n in grads[0])
    assert any("self_attn" in n and "lora_B" in n for n in grads[0])
    for name, expected in grads[0].items():
        assert expected is not None and expected.abs().sum() > 0, name
        # atol relative to the gradient's own scale where it exceeds 1: the hybrid families' expert gradients reach
        # ~24 (three Gated DeltaNet layers feed them), and one element of 4096 then differed by 2.2e-5 (1.6e-6 of
        # the largest), fp32 rounding of the two summation orders
        atol = ATOL * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(grads[1][name], expected, atol=atol, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


def test_parameters_and_state_dict_are_peft_s_exactly(base_path):
    materialized, factored = _pair(base_path)
    assert [n for n, _ in materialized.named_parameters()] == [n for n, _ in factored.named_parameters()]
    assert materialized.state_dict().keys() == factored.state_dict().keys()
    a, b = lora_state(materialized), lora_state(factored)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Same seed without any edit: the initial adapters are bit-identical too.
    fresh = [add_lora(load_fp32(base_path), _lora(materialized.config), 5, factored_experts=f) for f in (False, True)]
    a, b = lora_state(fresh[0]), lora_state(fresh[1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_disable_adapter_gives_the_base_logits(base_path):
    _, factored = _pair(base_path)
    ids = _ids(factored.config.vocab_size)
    with torch.no_grad():
        with factored.disable_adapter():
            got = factored(ids).logits
        expected = load_fp32(base_path)(ids).logits
        adapted = factored(ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert (adapted - expected).abs().max() > 1e-3  # the adapter does change the logits outside the context


def test_merged_adapter_gives_the_unmerged_logits(base_path):
    materialized, factored = _pair(base_path)
    ids = _ids(factored.config.vocab_size)
    with torch.no_grad():
        expected = materialized(ids).logits
        factored.merge_adapter()
        merged = factored(ids).logits
        factored.unmerge_adapter()
        unmerged = factored(ids).logits
    torch.testing.assert_close(merged, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(unmerged, expected, atol=ATOL, rtol=RTOL)


def test_route_replay_logits_equal_materialized(base_path):
    materialized, factored = _pair(base_path)
    ids = _ids(materialized.config.vocab_size, batch=1, seq=9)
    T = ids.numel()
    layers, k = len(find_routers(materialized)), materialized.config.num_experts_per_tok
    experts = _expert_wrappers(materialized)[0].base_layer.base_layer.gate_up_proj.shape[0]
    gen = torch.Generator().manual_seed(4)
    routes_T_L_K = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(T * layers)])
    routes_T_L_K = routes_T_L_K.view(T, layers, k)
    ok_T = torch.ones(T, dtype=torch.bool)
    ok_T[3] = False  # one token keeps its native route
    logits, native = [], []
    for model in (materialized, factored):
        with RouteReplay(model) as replay, torch.no_grad():
            replay.set(routes_T_L_K, ok_T)
            logits.append(model(ids).logits)
            native.append(replay.native())
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=RTOL)
    assert torch.equal(native[0], native[1])
    with torch.no_grad():  # the replay did force other experts than the routers' own
        assert (factored(ids).logits - logits[1]).abs().max() > 1e-4


def test_sentinel_expert_ids_are_skipped(random_qwen3_path):
    """An id equal to E (transformers' expert-parallel sentinel) contributes nothing, as in transformers' forwards."""
    _, factored = _pair(random_qwen3_path)
    outer = _expert_wrappers(factored)[0]
    experts = outer.base_layer.base_layer
    x = torch.randn(5, experts.hidden_dim, generator=torch.Generator().manual_seed(6))
    index = torch.tensor([[0, 3], [4, 1], [2, 4], [1, 0], [3, 2]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = experts_forward(experts, outer.base_layer, outer, "default", x, index, weights)
        kept = torch.where(index == 4, torch.zeros_like(weights), weights)
        expected = experts_forward(experts, outer.base_layer, outer, "default", x, index.clamp(max=3), kept)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def _saved_storages(model, ids) -> list[int]:
    """Bytes of each unique non-parameter storage saved for backward, for one forward."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids).logits
    del logits
    return list(seen.values())


def test_factored_forward_saves_nothing_expert_stack_sized(base_path):
    """PEFT saves a materialized W + s·B A per MoE layer; the factored forward none. Counted as storages at least one
    expert stack large, since at these tiny dims a Gated DeltaNet layer saves its own [B, H, 64, 64] chunk matrix,
    which is exactly that size (131072 B) and is saved by both models alike."""
    materialized, factored = _pair(base_path)
    ids = _ids(materialized.config.vocab_size)
    experts = _expert_wrappers(factored)[0].base_layer.base_layer
    stack_bytes = experts.gate_up_proj.numel() * 4  # one materialized gate_up W + s·B A in fp32
    mat, fac = _saved_storages(materialized, ids), _saved_storages(factored, ids)
    mat_big, fac_big = sum(b >= stack_bytes for b in mat), sum(b >= stack_bytes for b in fac)
    family = materialized.config.model_type
    print(f"\n{family}: saved for backward, materialized {sum(mat)} B ({mat_big} storages >= one stack), "
          f"factored {sum(fac)} B ({fac_big}); one expert stack {stack_bytes} B")  # fmt: skip
    assert mat_big > fac_big
    if "linear_attention" not in (getattr(materialized.config, "layer_types", None) or []):
        assert fac_big == 0
    assert sum(fac) < sum(mat)


def test_an_unsupported_experts_layout_is_refused_by_name(random_qwen3_path):
    """A layout the factored math does not mirror (here: experts with biases) fails loudly at add_lora, instead of
    computing something else; the materialized path still builds."""
    base = load_fp32(random_qwen3_path)
    for module in base.modules():
        if type(module).__name__.endswith("Experts"):
            module.has_bias = True
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.experts.*Qwen3MoeExperts.*has_bias"):
        add_lora(base, LoraConfig(), seed=0)
    base = load_fp32(random_qwen3_path)
    for module in base.modules():
        if type(module).__name__.endswith("Experts"):
            module.has_bias = True
    assert not any(is_factored(m) for m in _expert_wrappers(add_lora(base, LoraConfig(), 0, factored_experts=False)))


def test_lora_takes_the_base_dtype_everywhere():
    """One LoRA dtype, the recipe's, in learner, rollout and server (PEFT would upcast bf16 adapters)."""
    from transformers import AutoModelForCausalLM

    from mint.config import LoraConfig
    from mint.models.lora import add_lora
    from mint.models.specs import tiny_config

    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", 97), dtype=torch.bfloat16).requires_grad_(False)
    model = add_lora(base, LoraConfig(), seed=0)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.bfloat16}
