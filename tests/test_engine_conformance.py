"""Mint's engine launch lines and route decoding, checked against vLLM's and SGLang's own code.

The engines live in a virtualenv of their own (`make engines`; the `engine_python` fixture), so each engine's code
runs in one subprocess per check (tests/engine_scripts/*.py, all cases at once: importing vLLM alone takes ~10 s on
2 cores) and reports JSON; Mint's side runs here.

- Launch lines: for each family Mint serves (tiny qwen3_moe, qwen2_moe, glm4_moe, dense qwen3) and LoRA ranks 4..512,
  `launch_argv` renders the default vLLM / SGLang argv, and the engine's own parser and validation take it and end
  up with what Mint asked for (LoRA rank, modules, tensor parallel size, dtype, routed experts exactly on MoE bases).
- Routes: ids placed on the MoE layers by the engine's own capture buffer (vLLM: its capturer bound to the real model
  class's routers; SGLang: its capturer's layout) and encoded by the engine's own encoder come back through
  `decode_npy` / `decode_int32` and `split_routes` as the MoE layers' ids, prompt and response parts.

What runs where, and what each script substitutes on a CPU without Triton or torchvision, is in the scripts'
docstrings; nothing is downloaded (the bases are config.json files, vLLM builds them with dummy weights).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_engine_script
from transformers import AutoConfig

from mint.config import load_config
from mint.models.specs import moe_layout, tiny_config
from mint.rollout.backends.base import decode_int32, decode_npy, split_routes
from mint.train.engine_launch import launch_argv, lora_modules

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 97
# The architecture each saved config names: the engines pick their model class by it (vLLM reads a config without
# one as an embedding model).
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
FAMILIES = tuple(ARCHITECTURES)
# Where each tiny family's MoE layers sit among its decoder layers (tiny_config: GLM's first layer is dense).
MOE_LAYER_IDS = {"qwen3_moe": (0, 1), "qwen2_moe": (0, 1), "glm4_moe": (1, 2)}
# 4 and 24 are ranks vLLM's --max-lora-rank does not take (1, 8, 16, 32, ...): Mint rounds them up.
RANKS = (4, 8, 24, 64, 512)
# A qwen3_moe with more experts than uint8 holds: vLLM then sends its routes as uint16.
WIDE = {"num_experts": 320}
NUM_PROMPT, NUM_RESPONSE = 4, 3
# Four subprocesses in the engine virtualenv, each importing vLLM or SGLang (~10 s on 2 cores before any check), and
# `make test-fast` installs no engines: the full suite only. Mint's side of the launch lines is in test_engines.py.
pytestmark = pytest.mark.slow


def save_base(directory: Path, family: str, **overrides) -> str:
    """A tiny base of `family` as the engines read it: its config.json only (nothing here loads weights)."""
    config = tiny_config(family, VOCAB, **overrides)
    config.architectures = [ARCHITECTURES[family]]
    config.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """family -> a saved tiny base (config.json), plus "wide": a qwen3_moe with 320 experts."""
    root = tmp_path_factory.mktemp("bases")
    saved = {family: save_base(root / family, family) for family in FAMILIES}
    saved["wide"] = save_base(root / "wide", "qwen3_moe", **WIDE)
    return saved


def rendered(backend: str, family: str, rank: int, model: str):
    """(Mint's config, the argv Mint launches that engine with) for the default launch line of `backend`."""
    config = load_config(
        ROOT / "recipes/smoke.toml",
        [f"rollout.backend={backend}", "engines.start=1", f"lora.rank={rank}", f"model.path={model}"],
    )
    moe = moe_layout(AutoConfig.from_pretrained(model)) is not None  # as EngineServers.start reads it off the base
    return config, launch_argv(config, {"model": model, "host": "127.0.0.1", "port": 8000, "moe": moe})


def launch_report(engine_python, bases, tmp_path_factory, backend: str, script: str) -> dict:
    cases = [
        {"name": f"{family}-{rank}", "argv": rendered(backend, family, rank, bases[family])[1]}
        for family in FAMILIES
        for rank in RANKS
    ]
    return run_engine_script(engine_python, script, cases, tmp_path_factory.mktemp(f"{backend}-launch"))


@pytest.fixture(scope="module")
def vllm_launch(engine_python, bases, tmp_path_factory) -> dict:
    return launch_report(engine_python, bases, tmp_path_factory, "vllm", "parse_vllm.py")


@pytest.fixture(scope="module")
def sglang_launch(engine_python, bases, tmp_path_factory) -> dict:
    report = launch_report(engine_python, bases, tmp_path_factory, "sglang", "parse_sglang.py")
    first = next(iter(report.values()))
    if first["stage"] == "import":
        pytest.fail(
            f"SGLang's server_args does not import in the engine virtualenv ({first['error']}): `make engines` "
            "installs SGLang without its dependencies, and its argument parser also imports orjson, IPython and "
            "traitlets, which must be installed there too (pip install --no-deps orjson ipython traitlets)"
        )
    return report


def refused(report: dict) -> str:
    return f"refused at {report['stage']}: {report['error']}"


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_takes_mints_launch_line_and_configures_what_mint_asked(vllm_launch, bases, family, rank):
    """`vllm serve` through vLLM's own parser and create_engine_config. The launch line this replaced passed
    --max-lora-rank 4 or 24 as is (vLLM's parser refuses both: it takes 1, 8, 16, 32, ...), passed
    --enable-return-routed-experts on a dense base (vLLM: "AuxOutput Connector only supports MoE models") and no
    --dtype (vLLM served the fp32 checkpoint in bfloat16)."""
    config, _ = rendered("vllm", family, rank, bases[family])
    report = vllm_launch[f"{family}-{rank}"]
    assert report["ok"], refused(report)
    got = report["config"]
    assert got["model"] == bases[family]
    assert got["max_lora_rank"] >= rank  # vLLM's LoRA slots hold an adapter of lora.rank
    assert got["tp"] == config.engines.tp
    assert got["dtype"] == config.model.dtype
    assert got["is_moe"] == (family in MOE_LAYER_IDS)
    assert got["routed_experts"] == (family in MOE_LAYER_IDS)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_takes_mints_launch_line_and_configures_what_mint_asked(sglang_launch, bases, family, rank):
    """`python -m sglang.launch_server` through SGLang's own prepare_server_args and its LoRA validation. The launch
    line this replaced filled {lora_modules} into one argv word, "q_proj k_proj ... down_proj", which SGLang's
    --lora-target-modules refuses as an invalid choice, and passed no --dtype."""
    config, _ = rendered("sglang", family, rank, bases[family])
    report = sglang_launch[f"{family}-{rank}"]
    assert report["ok"], refused(report)
    got = report["args"]
    assert got["model"] == bases[family]
    assert got["enable_lora"] is True
    assert got["max_lora_rank"] >= rank
    assert got["lora_modules"] == sorted(lora_modules(config))  # every module the adapter directories hold
    assert got["tp"] == config.engines.tp
    assert got["dtype"] == config.model.dtype
    assert got["routed_experts"] == (family in MOE_LAYER_IDS)


# ---- routes ---------------------------------------------------------------------------------------------------------

ROUTE_CASES = {  # name (a key of `bases`) -> (family, MoE layer ids, tiny_config overrides)
    "qwen3_moe": ("qwen3_moe", MOE_LAYER_IDS["qwen3_moe"], {}),
    "qwen2_moe": ("qwen2_moe", MOE_LAYER_IDS["qwen2_moe"], {}),
    "glm4_moe": ("glm4_moe", MOE_LAYER_IDS["glm4_moe"], {}),
    "wide": ("qwen3_moe", MOE_LAYER_IDS["qwen3_moe"], WIDE),
}


def route_ids(name: str) -> torch.Tensor:
    """[P+R-1, L_moe, k] distinct top-k expert ids per position and MoE layer (seeded per case)."""
    family, layer_ids, overrides = ROUTE_CASES[name]
    config = tiny_config(family, VOCAB, **overrides)
    num_experts = getattr(config, "num_experts", None) or config.n_routed_experts
    gen = torch.Generator().manual_seed(sorted(ROUTE_CASES).index(name))
    rows = NUM_PROMPT + NUM_RESPONSE - 1
    picks = [
        torch.randperm(num_experts, generator=gen)[: config.num_experts_per_tok] for _ in range(rows * len(layer_ids))
    ]
    return torch.stack(picks).reshape(rows, len(layer_ids), config.num_experts_per_tok)


def route_cases(bases: dict[str, str], dense: bool = False) -> list[dict]:
    cases = [
        {"name": name, "model": bases[name], "layer_ids": list(ids), "ids": route_ids(name).tolist()}
        for name, (_, ids, _) in ROUTE_CASES.items()
    ]
    if dense:  # no MoE layer: an engine has no routes to capture
        rows = NUM_PROMPT + NUM_RESPONSE - 1
        cases.append({"name": "qwen3", "model": bases["qwen3"], "layer_ids": [], "ids": [[]] * rows})
    return cases


@pytest.fixture(scope="module")
def vllm_routes(engine_python, bases, tmp_path_factory) -> dict:
    return run_engine_script(
        engine_python, "routes_vllm.py", route_cases(bases, dense=True), tmp_path_factory.mktemp("vr")
    )


@pytest.fixture(scope="module")
def sglang_routes(engine_python, bases, tmp_path_factory) -> dict:
    return run_engine_script(engine_python, "routes_sglang.py", route_cases(bases), tmp_path_factory.mktemp("sr"))


def layout_of(name: str):
    family, _, overrides = ROUTE_CASES[name]
    return moe_layout(tiny_config(family, VOCAB, **overrides))


def assert_split_into_moe_layers(rows: np.ndarray | None, name: str) -> None:
    """split_routes(rows) gives the case's ids: prompt part [P-1, L_moe, k], response part [R, L_moe, k]."""
    ids = route_ids(name)
    prompt, response = split_routes(rows, NUM_PROMPT, NUM_RESPONSE, layout_of(name))
    assert prompt is not None and response is not None, f"split_routes dropped {name}'s routes of shape {rows.shape}"
    assert prompt.shape == (NUM_PROMPT - 1, *ids.shape[1:]) and response.shape == (NUM_RESPONSE, *ids.shape[1:])
    assert torch.equal(prompt.long(), ids[: NUM_PROMPT - 1]), name
    assert torch.equal(response.long(), ids[NUM_PROMPT - 1 :]), name


@pytest.mark.parametrize("name", ROUTE_CASES)
def test_vllm_routes_decode_to_the_moe_layers(vllm_routes, name):
    """vLLM's capturer, bound to the real model class's routers, sends one row per decoder layer ([P+R-1, 3, 2] for
    the GLM base, whose dense first layer stays zero), as numpy2base64's .npy, uint8 or uint16 past 256 experts.
    split_routes once passed those 3 rows on where the learner replays 2 MoE layers."""
    report = vllm_routes[name]
    assert "error" not in report, report["error"]
    family, layer_ids, overrides = ROUTE_CASES[name]
    config = tiny_config(family, VOCAB, **overrides)
    assert tuple(report["layer_ids"]) == layer_ids  # vLLM's model class has its MoE layers where the family has them
    assert tuple(report["layer_ids"]) == layout_of(name).moe_layer_ids  # and Mint's layout reads them there
    rows = decode_npy(report["encoded"])
    assert rows.shape == (NUM_PROMPT + NUM_RESPONSE - 1, config.num_hidden_layers, config.num_experts_per_tok)
    assert rows.dtype == (np.uint16 if name == "wide" else np.uint8)
    assert_split_into_moe_layers(rows, name)


def test_vllm_has_no_routes_for_a_dense_base_and_mint_expects_none(vllm_routes):
    """vLLM's capturer refuses a dense base (no experts to record; so Mint leaves --enable-return-routed-experts
    off), and Mint's layout of it is None, so split_routes asks for no routes."""
    error = vllm_routes["qwen3"].get("error", "")
    assert "Routed-experts capture requires positive" in error and "num_experts=0" in error, vllm_routes["qwen3"]
    assert moe_layout(tiny_config("qwen3", VOCAB)) is None
    assert split_routes(np.zeros((6, 2, 2), np.uint8), NUM_PROMPT, NUM_RESPONSE, None) == (None, None)


@pytest.mark.parametrize("name", ROUTE_CASES)
def test_sglang_routes_decode_to_the_moe_layers(sglang_routes, name):
    """SGLang's detokenizer sends raw int32 of [P+R-1, all decoder layers, k] without its shape; decode_int32 gives
    [P+R-1, 1, 3 * 2] for the GLM base, which split_routes once passed on unreshaped (it expected 2 * 2 ids a row)."""
    report = sglang_routes[name]
    assert "error" not in report, report["error"]
    family, _, overrides = ROUTE_CASES[name]
    assert report["num_layers"] == tiny_config(family, VOCAB, **overrides).num_hidden_layers
    rows = decode_int32(report["encoded"], NUM_PROMPT + NUM_RESPONSE - 1)
    assert rows is not None
    assert_split_into_moe_layers(rows, name)
