"""The embedded tiny bases: local tokenizer, noisy-label pretraining to a partial skill, and the atomic cache."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from longstraw.routing import find_routers
from mint.errors import ConfigError
from mint.models import tiny, tiny_rebuild, tiny_ship
from mint.models.specs import HYBRID_FAMILIES, MLA_FAMILIES, TINY_FAMILIES, moe_layout, tiny_config
from mint.models.tiny import (
    BUILD_VERSION,
    IM_END,
    MANIFEST,
    REQUIRED_FILES,
    TinyRecipe,
    build_tokenizer,
    ensure_tiny,
    resolve_model_path,
)

FAMILIES = TINY_FAMILIES
SHIPPED_DIR = tiny_ship.SHIPPED_DIR  # the real one: some fixtures point tiny_ship elsewhere
PROMPT = "What is the first digit of 3 7 1 4?"
# The saved model_type where it is not the family's name: the text models of the Qwen3.5 checkpoints.
MODEL_TYPES = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5": "qwen3_5_text"}
SHARED_EXPERT = ("qwen2_moe", "qwen3_5_moe", "qwen3_next")  # families whose MoE has a sigmoid-gated shared expert


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    """The default base of every family through ensure_tiny: the shipped bytes, copied into a fresh cache."""
    cache = str(tmp_path_factory.mktemp("mint_cache"))
    return {family: ensure_tiny(family, cache) for family in FAMILIES}


def test_tokenizer_round_trips_any_text(tokenizer):
    for text in (PROMPT, "12 + 7 = 19", "Héllo wörld 🙂\n\ttabs  and  spaces", "<|im_start|>user\nhi<|im_end|>"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert 300 <= len(tokenizer) <= 512


def test_digits_and_end_of_turn_are_single_tokens(tokenizer):
    for d in range(10):
        assert tokenizer(str(d), add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(str(d))]
    assert tokenizer(IM_END, add_special_tokens=False)["input_ids"] == [tokenizer.eos_token_id]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # The answer after the generation prompt stays one token: prompt ids + answer ids == ids of the joined text.
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    joined = tokenizer(prompt + "3" + IM_END, add_special_tokens=False)["input_ids"]
    alone = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert joined == [*alone, tokenizer.convert_tokens_to_ids("3"), tokenizer.eos_token_id]


def test_chat_template_renders_chatml(tokenizer):
    user = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(user, tokenize=False) == f"<|im_start|>user\n{PROMPT}<|im_end|>\n"
    chat = [{"role": "system", "content": "Be brief."}, *user, {"role": "assistant", "content": "3"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    system = "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert text == f"{system}<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert tokens[:3] == ["<|im_start|>", "system", "Ċ"] and tokens[-5:] == ["assistant", "Ċ", "3", "<|im_end|>", "Ċ"]


def test_tokenizer_is_deterministic(tokenizer):
    assert build_tokenizer().backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


@pytest.mark.parametrize("family", FAMILIES)
def test_build_saves_and_loads_through_from_pretrained(tiny_paths, family):
    path = tiny_paths[family]
    assert all(os.path.isfile(os.path.join(path, f)) for f in REQUIRED_FILES)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == MODEL_TYPES.get(family, family)
    assert model.config.vocab_size == len(tok)
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert (tok.eos_token_id, tok.pad_token_id) == (im_end, pad)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (im_end, pad)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (im_end, pad)
    assert hasattr(model.model.layers[0].mlp, "shared_expert") == (family in SHARED_EXPERT)
    if family == "glm4_moe":  # a dense first layer, then MoE layers with a shared expert
        dense, *moe = model.model.layers
        assert not hasattr(dense.mlp, "experts") and all(hasattr(layer.mlp, "shared_experts") for layer in moe)
        assert moe_layout(model.config).num_layers == len(find_routers(model)) == 2
        assert model.config.n_group == 2 and model.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    manifest = _manifest(path)
    assert manifest["recipe"]["family"] == family and manifest["pretrain_seconds"] > 0
    assert 0 < manifest["skill_steps"] < manifest["recipe"]["steps"], "the skill phase hit its step cap"


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_bases_interleave_gated_deltanet_with_full_attention(tiny_paths, family):
    """Three Gated DeltaNet layers then one gated full-attention layer; in the MoE families every layer routes (4
    experts, top-2), and moe_layout says so; the dense qwen3_5 has no layout and no router."""
    model = AutoModelForCausalLM.from_pretrained(tiny_paths[family])
    schedule = ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.layer_types == schedule
    mixers = ["linear_attention" if hasattr(layer, "linear_attn") else "full_attention" for layer in model.model.layers]
    assert mixers == schedule
    assert not hasattr(model.model.layers[3], "linear_attn") and hasattr(model.model.layers[3], "self_attn")
    assert model.config.head_dim == 32 and model.config.rope_parameters["partial_rotary_factor"] == 0.25
    layout = moe_layout(model.config)
    assert layout == moe_layout(tiny_config(family, 97))
    if family == "qwen3_5":
        assert layout is None and not any(hasattr(layer.mlp, "experts") for layer in model.model.layers)
        return
    assert (layout.num_layers, layout.num_experts, layout.top_k) == (4, 4, 2)
    assert layout.layer_ids == (0, 1, 2, 3) and layout.num_decoder_layers == 4
    assert len(find_routers(model)) == 4


SHIPPED_MLA = [f for f in MLA_FAMILIES if f in FAMILIES]


def test_mla_families_shipped():
    """DeepSeek-V3, GLM-4.7-Flash and GLM-5 are shipped; DeepSeek-V3.2 stays a config (docs/decisions.md)."""
    assert SHIPPED_MLA == ["deepseek_v3", "glm4_moe_lite", "glm_moe_dsa"]


def test_mla_recipes_differ_only_where_mla_recipe_says():
    """The latent-attention families' default recipe takes MLA_RECIPE's skill-phase cap and calibration steps (the
    shared 1500 / 300 left their first_last skill at greedy 0.37-0.64); every other field is the shared default, an
    explicit value is kept, and the other families' recipes are untouched."""
    assert set(tiny.MLA_RECIPE) == {"steps", "calibrate_steps"}
    for family in SHIPPED_MLA:
        recipe = TinyRecipe(family)
        assert (recipe.steps, recipe.calibrate_steps) == (tiny.MLA_RECIPE["steps"], tiny.MLA_RECIPE["calibrate_steps"])
        assert TinyRecipe(family, steps=7, calibrate_steps=5) == dataclasses.replace(recipe, steps=7, calibrate_steps=5)
        assert (TinyRecipe(family, steps=7).steps, TinyRecipe(family, calibrate_steps=5).calibrate_steps) == (7, 5)
        shared = {k: v for k, v in dataclasses.asdict(recipe).items() if k not in ("family", *tiny.MLA_RECIPE)}
        assert shared == {k: v for k, v in dataclasses.asdict(TinyRecipe("qwen3_moe")).items() if k in shared}
    assert (TinyRecipe("glm4_moe").steps, TinyRecipe("glm4_moe").calibrate_steps) == (1500, 300)


@pytest.mark.parametrize("family", SHIPPED_MLA)
def test_mla_bases_have_latent_attention_and_a_dense_first_layer(tiny_paths, family):
    """Three layers of multi-head latent attention (q and kv down-projections of rank 32, RoPE on 16 of each head's
    32 query/key dims); the first layer's MLP is dense, the other two route to 4 experts (top-2) with a shared expert,
    and moe_layout says so. GLM-5 (glm_moe_dsa) adds DSA: an indexer in layers 0 and 1 (index_topk 64), and layer 2
    reuses layer 1's selection."""
    model = AutoModelForCausalLM.from_pretrained(tiny_paths[family])
    config = model.config
    dims = (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim)
    assert dims == (32, 32, 16, 16)
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.kv_a_proj_with_mqa.out_features == 32 + 16 and attn.kv_b_proj.in_features == 32
    dense, *moe = model.model.layers
    assert not hasattr(dense.mlp, "experts") and all(hasattr(layer.mlp, "shared_experts") for layer in moe)
    layout = moe_layout(config)
    assert layout == moe_layout(tiny_config(family, 97))
    assert (layout.num_layers, layout.num_experts, layout.top_k) == (2, 4, 2)
    assert layout.layer_ids == (1, 2) and layout.num_decoder_layers == 3
    assert len(find_routers(model)) == 2
    if family == "glm_moe_dsa":
        assert config.layer_types == ["indexed_attention"] * 3 and config.index_topk == 64
        assert config.indexer_types == ["full", "full", "shared"]
        assert [layer.self_attn.indexer is not None for layer in model.model.layers] == [True, True, False]
    else:
        assert not any(hasattr(layer.self_attn, "indexer") for layer in model.model.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_base_has_partial_skill(tiny_paths, family):
    """The correct digit is the mode (greedy right) but T=1 sampling is right only ~37% of the time; it stops after."""
    path = tiny_paths[family]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    examples = tiny.heldout_examples(400, seed=123)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False, add_generation_prompt=True)
        for ex in examples
    ]
    batch = tok(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    answer_B = torch.tensor(tok.convert_tokens_to_ids([ex.answer for ex in examples]))
    with torch.no_grad():
        probs_B_V = model(**batch).logits[:, -1].softmax(-1)
        sampled_B = torch.multinomial(probs_B_V, 1, generator=torch.Generator().manual_seed(0))[:, 0]
        # Append the sampled answer: the next token must end the turn, whatever digit was drawn.
        ids = torch.cat([batch["input_ids"], sampled_B[:, None]], 1)
        mask = torch.cat([batch["attention_mask"], torch.ones_like(sampled_B[:, None])], 1)
        next_B = model(input_ids=ids, attention_mask=mask).logits[:, -1].argmax(-1)
    greedy = (probs_B_V.argmax(-1) == answer_B).float().mean().item()
    sampled = (sampled_B == answer_B).float().mean().item()
    print(f"{family}: greedy {greedy:.3f} sampled {sampled:.3f}")
    assert greedy > 0.8
    assert 0.18 <= sampled <= 0.45  # chance is 0.1; the optimum with q = 0.3 is 0.37, the builds reach 0.23-0.35
    assert (next_B == tok.eos_token_id).float().mean().item() > 0.95
    accuracy = _manifest(path)["accuracy"]
    assert accuracy["greedy"] > 0.8 and 0.18 <= accuracy["sampled"] <= 0.45 and 0.22 <= accuracy["expected"] <= 0.35


def _manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def _state(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def test_build_is_deterministic(tmp_path):
    kw = dict(steps=3, calibrate_steps=2, eval_examples=8)
    a = tiny.build_tiny("qwen2_moe", str(tmp_path / "a"), seed=5, **kw)
    b = tiny.build_tiny("qwen2_moe", str(tmp_path / "b"), seed=5, **kw)
    c = tiny.build_tiny("qwen2_moe", str(tmp_path / "c"), seed=6, **kw)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    with open(os.path.join(a, "tokenizer.json")) as fa, open(os.path.join(b, "tokenizer.json")) as fb:
        assert fa.read() == fb.read()


@pytest.fixture
def counted_builds(monkeypatch, tmp_path):
    """ensure_tiny with MINT_CACHE in tmp_path, nothing shipped, and a cheap build_tiny that counts its calls."""
    monkeypatch.setenv("MINT_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny_ship, "SHIPPED_DIR", str(tmp_path / "nothing_shipped"))
    real, calls = tiny.build_tiny, []

    def cheap(family, directory, **kwargs):
        calls.append(directory)
        return real(family, directory, seed=kwargs["seed"], steps=2, calibrate_steps=1, eval_examples=4)

    monkeypatch.setattr(tiny, "build_tiny", cheap)
    return calls


def _target(cache: str, family: str = "qwen3_moe") -> str:
    return os.path.join(cache, "tiny", f"{family}-{TinyRecipe(family).key()}")


def test_ensure_tiny_builds_once_under_mint_cache(counted_builds, tmp_path):
    path = ensure_tiny("qwen3_moe")
    assert path == _target(str(tmp_path)) and tiny.is_complete(path)
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert ensure_tiny("qwen3_moe") == path
    assert resolve_model_path("tiny:qwen3_moe") == path
    assert len(counted_builds) == 1 and os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert os.listdir(os.path.join(tmp_path, "tiny")) == [os.path.basename(path)]  # no temp folder left behind


def test_ensure_tiny_ignores_partial_and_temp_folders(counted_builds, tmp_path):
    target = _target(str(tmp_path))
    os.makedirs(target)
    for name in REQUIRED_FILES:
        if name != "model.safetensors":
            Path(target, name).write_text("{}")
    leftover = os.path.join(tmp_path, "tiny", f".{os.path.basename(target)}.tmp-crashed")
    os.makedirs(leftover)
    for name in REQUIRED_FILES:
        Path(leftover, name).write_text("{}")
    os.utime(leftover, (0, 0))  # older than STALE_TEMP_SECONDS
    assert not tiny.is_complete(target)
    path = ensure_tiny("qwen3_moe")
    assert path == target and tiny.is_complete(path) and len(counted_builds) == 1
    AutoModelForCausalLM.from_pretrained(path)
    assert os.listdir(os.path.join(tmp_path, "tiny")) == [os.path.basename(target)]


def test_ensure_tiny_uses_the_winner_of_a_race(counted_builds, tmp_path, monkeypatch):
    build = tiny.build_tiny

    def racing(family, directory, **kwargs):
        build(family, directory, **kwargs)
        shutil.copytree(directory, _target(str(tmp_path)))  # another process finishes first
        Path(_target(str(tmp_path)), "theirs").touch()
        return directory

    monkeypatch.setattr(tiny, "build_tiny", racing)
    path = ensure_tiny("qwen3_moe")
    assert os.path.exists(os.path.join(path, "theirs"))
    assert os.listdir(os.path.join(tmp_path, "tiny")) == [os.path.basename(path)]


def test_resolve_model_path_passes_other_specs_through(tmp_path):
    assert resolve_model_path("Qwen/Qwen3-30B-A3B", str(tmp_path)) == "Qwen/Qwen3-30B-A3B"
    assert resolve_model_path("/models/local", str(tmp_path)) == "/models/local"
    with pytest.raises(ConfigError, match="unknown tiny family"):
        resolve_model_path("tiny:llama", str(tmp_path))
    assert not os.path.exists(os.path.join(tmp_path, "tiny"))


def _shipped(family: str) -> str:
    path = tiny_ship.shipped_path(f"{family}-{TinyRecipe(family).key()}", SHIPPED_DIR)
    assert path is not None, f"no shipped base for {family}'s recipe key: run `make tiny-bases`"
    return path


def test_only_current_recipe_keys_are_shipped():
    """A stale folder (an old recipe key) would be dead weight in the package: `make tiny-bases` removes them."""
    names = {f"{family}-{TinyRecipe(family).key()}" for family in FAMILIES}
    assert set(os.listdir(SHIPPED_DIR)) == names


@pytest.mark.parametrize("family", FAMILIES)
def test_shipped_base_matches_its_manifest_and_loads(family, tmp_path):
    """Every shipped file has the manifest's sha256, the base loads through from_pretrained, and it is still what
    build_tiny would build today: the same recipe, BUILD_VERSION, tokenizer and tiny_config (else `make tiny-bases`)."""
    path = _shipped(family)
    manifest = tiny_ship.read_manifest(path)
    assert set(os.listdir(path)) == {*manifest["sha256"], MANIFEST} and set(REQUIRED_FILES) <= set(os.listdir(path))
    assert tiny_ship.matches(path, manifest["sha256"])
    assert manifest["version"] == BUILD_VERSION and manifest["recipe"] == dataclasses.asdict(TinyRecipe(family))
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    build_tokenizer().save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        # A build saves the padding state its left-padded evaluation leaves on the backend: not the vocabulary.
        fresh, saved = (_json_without(os.path.join(d, name), "padding", "truncation") for d in (tmp_path, path))
        assert fresh == saved, name
    expected = tiny_config(
        family,
        vocab_size=len(tok),
        initializer_range=TinyRecipe.init_std,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    ).to_dict()
    skip = {"transformers_version", "dtype", "torch_dtype", "architectures", "_name_or_path"}
    assert {k: v for k, v in model.config.to_dict().items() if k not in skip} == {
        k: v for k, v in expected.items() if k not in skip
    }


def _json_without(path: str, *keys: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if k not in keys}


_DIGESTS_SCRIPT = """
import json, os, torch
from mint.models import tiny, tiny_ship
def no_build(*args, **kwargs):
    raise AssertionError("ensure_tiny built a base although one is shipped")
tiny.build_tiny = no_build
out = {f: tiny_ship.file_sha256(os.path.join(tiny.ensure_tiny(f), "model.safetensors")) for f in tiny.TINY_FAMILIES}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "digests": out}))
"""


# A fresh interpreter per capability (4.5 s of CPU each, 11-13 s on 2 shared cores): the machine's own kernels in
# test-fast, the forced ones in the full suite.
@pytest.mark.parametrize(
    "capability",
    [
        pytest.param("default", marks=pytest.mark.slow, id="default"),
        pytest.param("avx2", marks=pytest.mark.slow, id="avx2"),
        pytest.param(None, id="native"),
    ],
)
def test_ensure_tiny_gives_the_shipped_bytes_under_any_cpu_kernels(tmp_path, capability):
    """Built here, the bases' bytes followed ATEN_CPU_CAPABILITY (three digests per family, docs/decisions.md); through
    ensure_tiny every capability gets the shipped bytes, with no build (a fresh process each: torch reads the
    variable once)."""
    env = {**os.environ, "MINT_CACHE": str(tmp_path)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    proc = subprocess.run(
        [sys.executable, "-c", _DIGESTS_SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if capability is not None and out["capability"] != capability.upper():
        pytest.skip(f"this CPU cannot run ATEN_CPU_CAPABILITY={capability} (torch chose {out['capability']})")
    shipped = {f: tiny_ship.read_manifest(_shipped(f))["sha256"]["model.safetensors"] for f in FAMILIES}
    assert out["digests"] == shipped


def test_ensure_tiny_replaces_a_local_build_of_a_shipped_key(counted_builds, tmp_path, monkeypatch):
    """A cache folder built on this machine before the base was shipped (complete, same key, other bytes) is replaced
    by the shipped bytes; ensure_tiny then neither builds nor copies again."""
    path = ensure_tiny("qwen3_moe")  # a cheap local build: the fixture hides the shipped bases
    monkeypatch.setattr(tiny_ship, "SHIPPED_DIR", SHIPPED_DIR)  # now the base is shipped
    shipped = tiny_ship.read_manifest(_shipped("qwen3_moe"))["sha256"]
    assert not tiny_ship.matches(path, shipped)
    assert ensure_tiny("qwen3_moe") == path and tiny_ship.matches(path, shipped) and len(counted_builds) == 1
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert ensure_tiny("qwen3_moe") == path and os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert os.listdir(os.path.join(tmp_path, "tiny")) == [os.path.basename(path)]  # the old folder is gone


def test_ensure_tiny_refuses_a_shipped_base_whose_bytes_changed(tmp_path, monkeypatch):
    """A shipped file that no longer matches its manifest's sha256 (a bad install, an edited file) is an error, and
    nothing lands in the cache."""
    root = tmp_path / "shipped"
    shutil.copytree(_shipped("qwen3_moe"), root / os.path.basename(_shipped("qwen3_moe")))
    with open(root / os.path.basename(_shipped("qwen3_moe")) / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    monkeypatch.setattr(tiny_ship, "SHIPPED_DIR", str(root))
    with pytest.raises(tiny_ship.ShippedBaseError, match=r"model\.safetensors do not match"):
        ensure_tiny("qwen3_moe", str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache" / "tiny") == []


def test_ship_records_digests_and_drops_stale_keys(tmp_path, monkeypatch):
    """`make tiny-bases` (tiny_ship.ship), with a cheap build: the manifest gains every file's sha256 and what built
    it, an older key of the family is removed, other families stay, and ensure_tiny then copies the new folder."""
    real = tiny.build_tiny
    monkeypatch.setattr(
        tiny, "build_tiny", lambda family, d, **kw: real(family, d, steps=2, calibrate_steps=1, eval_examples=4)
    )
    (tmp_path / "qwen3_moe-0000000000000000").mkdir()
    (tmp_path / "qwen2_moe-0000000000000000").mkdir()
    path = tiny_rebuild.ship("qwen3_moe", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(path), "qwen2_moe-0000000000000000"])
    manifest = tiny_ship.read_manifest(path)
    assert set(manifest["sha256"]) == set(os.listdir(path)) - {MANIFEST} and tiny_ship.matches(path, manifest["sha256"])
    assert manifest["built_with"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert all(os.stat(os.path.join(path, f)).st_mode & 0o777 == 0o644 for f in os.listdir(path))  # installable
    monkeypatch.setattr(tiny_ship, "SHIPPED_DIR", str(tmp_path))
    cached = ensure_tiny("qwen3_moe", str(tmp_path / "cache"))
    assert tiny_ship.matches(cached, manifest["sha256"]) and tiny_ship.read_manifest(cached) == manifest


_BUILD_SCRIPT = """
import json, sys, torch
from mint.models import tiny
r = tiny.TinyRecipe(sys.argv[2])
tiny.build_tiny(r.family, sys.argv[1], seed=r.seed, label_accuracy=r.label_accuracy, steps=r.steps,
                calibrate_steps=r.calibrate_steps)
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability()}))
"""


# qwen3_moe only: every family runs the same build_tiny, and a hybrid's build costs 5 min on 2 shared cores (its
# Gated DeltaNet runs in plain torch), beyond the suite's budget; docs/decisions.md records the hybrid run by hand.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_a_fresh_build_on_other_kernels_reaches_the_shipped_skill(tmp_path, family):
    """build_tiny is still the code that made the shipped base: a fresh build under other CPU kernels than the shipped
    one's (1 thread: qwen3_moe 30-50 s) has
    other bytes but the partial skill the shipped manifest records.

    The build calibrates its sampled skill to the recipe's label accuracy, so `expected` and `sampled` (400 prompts
    per task) stay within 0.1 of the shipped figures: builds under default / avx2 / avx512 spread `expected` at most
    0.063, and `sampled` adds binomial noise of sd 0.023 per build at p ~ 0.3 (0.033 on a difference, so 0.1 is three
    sd). Greedy accuracy is not calibrated: it lands where the calibration stops, and builds spread it by 0.108
    (arithmetic: 0.8775 shipped, 0.985 under another machine's default kernels; docs/decisions.md). So greedy has a
    floor only, the shipped figure minus 0.1. A lost skill moves far more: greedy 0.95 -> 0.55 and sampled -> 0.1
    (chance)."""
    shipped = tiny_ship.read_manifest(_shipped(family))
    other = "avx2" if shipped["built_with"]["cpu_capability"] == "DEFAULT" else "default"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": other}
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, str(tmp_path), family],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    capability = json.loads(proc.stdout.strip().splitlines()[-1])["capability"]
    if capability == shipped["built_with"]["cpu_capability"]:
        pytest.skip(f"this CPU cannot run other kernels than the shipped base's {capability}")
    fresh = _manifest(str(tmp_path))
    print(f"fresh ({capability}): {fresh['accuracy_by_task']}\nshipped: {shipped['accuracy_by_task']}")
    for task, accuracy in shipped["accuracy_by_task"].items():
        for figure, value in accuracy.items():
            got = fresh["accuracy_by_task"][task][figure]
            if figure == "greedy":
                assert got >= value - 0.1, (task, figure)
            else:
                assert abs(got - value) <= 0.1, (task, figure)
    assert 0 < fresh["skill_steps"] < fresh["recipe"]["steps"]
