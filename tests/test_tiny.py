"""The embedded tiny bases: local tokenizer, noisy-label pretraining to a partial skill, and the atomic cache."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from longstraw.routing import find_routers
from mint.errors import ConfigError
from mint.models import tiny
from mint.models.specs import moe_layout
from mint.models.tiny import (
    IM_END,
    MANIFEST,
    REQUIRED_FILES,
    TinyRecipe,
    build_tokenizer,
    ensure_tiny,
    resolve_model_path,
)

FAMILIES = ("qwen3_moe", "qwen2_moe", "glm4_moe")
PROMPT = "What is the first digit of 3 7 1 4?"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    """Default builds of every family through ensure_tiny (14-23 s each on one thread), built once."""
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
    assert model.config.model_type == family
    assert model.config.vocab_size == len(tok)
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert (tok.eos_token_id, tok.pad_token_id) == (im_end, pad)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (im_end, pad)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (im_end, pad)
    assert hasattr(model.model.layers[0].mlp, "shared_expert") == (family == "qwen2_moe")
    if family == "glm4_moe":  # issue 11: a dense first layer, then MoE layers with a shared expert
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
    assert 0.18 <= sampled <= 0.45  # chance is 0.1; the noisy-label optimum with q = 0.2 is 0.28
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
    """ensure_tiny with MINT_CACHE in tmp_path and a cheap build_tiny that counts its calls."""
    monkeypatch.setenv("MINT_CACHE", str(tmp_path))
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
