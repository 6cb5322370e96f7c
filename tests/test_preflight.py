"""Preflight: a recipe whose inputs are wrong fails before anything starts.

A drill on the code before preflight: of 43 bad recipes, nine started Ray before failing (20-25 s, tracebacks of 35-54
lines), 13 moved the user's previous run aside first, and a 1031-token prompt on a 256-position model trained with
exit 0. Each case here runs twice: `preflight(load_config(...))` in this process, and the real `mint train` as a
user runs it, which must exit 2 with one stderr line, quickly, leaving the previous run directory as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mint.config import build_config, load_config
from mint.errors import ConfigError
from mint.models.tiny import ensure_tiny
from mint.train import preflight as preflight_module
from mint.train.preflight import SYNTHETIC_BATCHES, Preflight, check_prompt_lengths, cpu_fp16_supported, preflight

ROOT = Path(__file__).resolve().parents[1]

RECIPE = """\
# A small valid recipe: the cases below break one thing each.
[model]
path = "tiny:qwen3_moe"

[data]
source = "synthetic:first_last"

[rollout]
group_size = 2
prompts_per_step = 2
max_tokens = 8

[grpo]
steps = 1

[learner]
num_ranks = 1
inner_step = "naive"

[logging]
name = "prev"
progress = false
"""

REWARDS = """\
def boom(response, answer):
    raise ValueError("boom on " + answer)


def words(response, answer):
    return "yes"
"""
REWARD_MODULE = "mint_preflight_test_rewards"

# 1015 tokens with the tiny tokenizer's chat template: every digit is its own token, and so is every space.
LONG_PROMPT = "What is the first digit of " + " ".join(str(i % 10) for i in range(500)) + "?"


@dataclass(frozen=True)
class Case:
    id: str
    overrides: tuple[str, ...]
    key: str  # the dotted key the message starts with; "" for a recipe-file problem (it starts with the path)
    message: str  # and holds this
    stage: str = "preflight"  # or "config": refused by load_config, before preflight
    recipe: str = "recipe"  # the file under inputs/ given as the recipe: recipe, binary, directory or empty


CASES = [
    Case("reward_unknown_name", ("data.reward=exact_mtch",), "data.reward", "unknown reward 'exact_mtch'"),
    Case(
        "reward_module_does_not_import",
        ("data.reward=mint_no_such_pkg.rewards:score",),
        "data.reward",
        "cannot import 'mint_no_such_pkg.rewards': ModuleNotFoundError",
    ),
    Case("reward_raises_on_sample", (f"data.reward={REWARD_MODULE}:boom",), "data.reward", "ValueError: boom on "),
    Case(
        "model_path_does_not_exist",
        ("model.path=/nonexistent/mint-model",),
        "model.path",
        "/nonexistent/mint-model does not exist",
    ),
    Case("model_dir_without_config", ("model.path={inputs}/notamodel",), "model.path", "has no config.json"),
    Case(
        "stop_string_of_several_tokens",
        ("rollout.stop_tokens=['</answer>']",),
        "rollout.stop_tokens",
        "'</answer>' is 8 tokens for this tokenizer, not one",
    ),
    Case(
        "prompt_longer_than_the_context",
        ("data.source={inputs}/long.jsonl",),
        "data.source",
        "record 1 (0-based) is 1015 tokens with the chat template, over the 248 that fit the model's 256 positions",
    ),
    # The run starts the engines minutes later (Ray, the learner, the model load); the engine then refused at start.
    Case(
        "vllm_engines_with_lora_rank_above_512",
        ("rollout.backend=vllm", "engines.start=1", "lora.rank=640"),
        "lora.rank",
        "640 is above 512, the largest --max-lora-rank vLLM accepts",
    ),
    Case(
        "sglang_engines_with_a_lora_module_sglang_does_not_take",
        ("rollout.backend=sglang", "engines.start=1", "lora.target_modules=['q_proj', 'c_attn']"),
        "lora.target_modules",
        "SGLang's --lora-target-modules does not take 'c_attn'",
    ),
    Case(
        "indexer_replay_on_a_base_without_dsa",
        ("grpo.indexer_replay=true",),
        "grpo.indexer_replay",
        "qwen3_moe has no DSA indexer to replay",
    ),
    Case(
        "indexer_replay_with_the_naive_inner_step",
        ("model.path=tiny:glm_moe_dsa", "grpo.indexer_replay=true", "learner.inner_step=naive"),
        "grpo.indexer_replay",
        "only the longstraw inner step replays",
    ),
    Case("recipe_is_binary", (), "", "not UTF-8 text", "config", "binary"),
    Case("recipe_is_a_directory", (), "", "cannot read the recipe", "config", "directory"),
    Case("recipe_is_empty", (), "", "the recipe is empty", "config", "empty"),
    Case("lr_nan", ("learner.lr=nan",), "learner.lr", "nan is not a finite number", "config"),
    Case("lr_inf", ("learner.lr=inf",), "learner.lr", "inf is not a finite number", "config"),
    Case(
        "temperature_nan", ("rollout.temperature=nan",), "rollout.temperature", "nan is not a finite number", "config"
    ),
    Case("logging_name_empty", ("logging.name=",), "logging.name", "'' is not a plain folder name", "config"),
    Case("logging_name_escapes_root", ("logging.name=../x",), "logging.name", "'../x' is not a plain", "config"),
]

# Inputs the actors refused after Ray started (the learner, the rollout actor), or the driver after it had moved the
# previous run aside (catalog.path). Run in process like CASES, without a time limit, and as real processes (7 `mint
# train` runs: 24 s of CPU, 45-67 s on 2 shared cores) in the full suite only.
STARTED_CASES = [
    Case(
        "expert_parallel_that_does_not_divide_the_experts",
        ("learner.num_ranks=3", "learner.expert_parallel=3"),
        "learner.expert_parallel",
        "3 does not divide the base's experts (4 routed experts)",
    ),
    Case(
        "expert_parallel_on_a_dense_base",
        ("model.path=tiny:qwen3", "learner.num_ranks=2", "learner.expert_parallel=2"),
        "learner.expert_parallel",
        "2 does not divide the base's experts (no routed experts)",
    ),
    Case(
        "expert_parallel_with_resident_mode",
        ("learner.num_ranks=2", "learner.expert_parallel=2", "learner.inner_step=longstraw", "longstraw.mode=resident"),
        "learner.expert_parallel",
        "resident mode is not supported with expert parallel",
    ),
    Case(
        "adapter_layout_vllm_cannot_read",
        ("rollout.backend=vllm", "engines.urls=['http://127.0.0.1:9']", "engines.adapter_layout=peft"),
        "engines.adapter_layout",
        "vllm reads qwen3_moe expert LoRA in the per-expert layout, not peft",
    ),
    Case(
        "eval_prompt_longer_than_the_context",
        ("eval.source={inputs}/long.jsonl",),
        "eval.source",
        "record 1 (0-based) is 1015 tokens with the chat template, over the 248 that fit the model's 256 positions",
    ),
    Case("catalog_is_a_regular_file", ("catalog.path={inputs}/catalog.db",), "catalog.path", "catalog.db is a file"),
    Case(
        "catalog_under_a_regular_file",
        ("catalog.path={inputs}/catalog.db/revisions",),
        "catalog.path",
        "cannot be made: ",
    ),
]


@pytest.fixture(scope="session")
def tiny_base() -> str:
    """The cached tiny:qwen3_moe base in the default cache ($MINT_CACHE or ~/.cache/mint), which the `mint train`
    subprocesses use too; built once (about 20 s) when absent."""
    return ensure_tiny("qwen3_moe")


@dataclass(frozen=True)
class Inputs:
    dir: Path  # recipes, data, model directories, the reward module
    root: Path  # logging.root, holding a previous run under "prev" (the recipe's name) and "mint" (the default)

    def args(self, case: Case) -> tuple[Path, list[str]]:
        overrides = [o.replace("{inputs}", str(self.dir)) for o in case.overrides]
        return self.dir / f"{case.recipe}.toml", [*overrides, f"logging.root={self.root}"]


@pytest.fixture
def inputs(tmp_path, tiny_base, monkeypatch) -> Inputs:
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "recipe.toml").write_text(RECIPE)
    (d / "binary.toml").write_bytes(bytes(range(256)) * 4)
    (d / "directory.toml").mkdir()
    (d / "empty.toml").write_text("# nothing but a comment\n")
    (d / f"{REWARD_MODULE}.py").write_text(REWARDS)
    (d / "notamodel").mkdir()
    (d / "notamodel" / "tokenizer.json").write_text("{}")
    (d / "catalog.db").write_text("a regular file, not the catalog's directory")
    records = [{"prompt": "What is the last digit of 1 2 3?", "answer": "3"}, {"prompt": LONG_PROMPT, "answer": "0"}]
    (d / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.syspath_prepend(str(d))
    root = tmp_path / "runs"
    for name in ("prev", "mint"):
        (root / name).mkdir(parents=True)
        (root / name / "marker.txt").write_text(f"the previous run {name}")
    return Inputs(d, root)


def _snapshot(tmp_path: Path) -> dict[str, bytes]:
    """Every path under tmp_path except the inputs, with its bytes: catches a run directory created, moved aside
    (`prev.<stamp>`), or written outside logging.root (`../x`)."""
    return {
        str(p.relative_to(tmp_path)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(tmp_path.rglob("*"))
        if p.relative_to(tmp_path).parts[0] != "inputs"
    }


def _check_message(case: Case, message: str, recipe: Path) -> None:
    assert "\n" not in message, message
    assert message.startswith(f"{case.key}: " if case.key else f"{recipe}: "), message
    assert case.message in message, message


@pytest.mark.parametrize("case", CASES + STARTED_CASES, ids=lambda c: c.id)
def test_bad_recipe_refused_in_process(case, inputs, tmp_path):
    """load_config then preflight, as `mint train` will run them: one ConfigError line naming the key."""
    recipe, overrides = inputs.args(case)
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError) as err:
        config = load_config(recipe, overrides)
        assert case.stage == "preflight", f"load_config accepted {case.id}"
        preflight(config)
    _check_message(case, str(err.value), recipe)
    assert _snapshot(tmp_path) == before


# As real processes, two cases import transformers and load the base's tokenizer before refusing (5 s of CPU each,
# 12-18 s on 2 shared cores, where the others take 0.1-0.2 s of CPU): the full suite only. In process, all run in
# test-fast.
SLOW_AS_A_PROCESS = {"prompt_longer_than_the_context", "stop_string_of_several_tokens"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=pytest.mark.slow if c.id in SLOW_AS_A_PROCESS else ()) for c in CASES]
)
def test_bad_recipe_fails_fast_as_a_real_process(case, inputs, tmp_path):
    """`mint train` as a user runs it: exit 2, one line on stderr (a started Ray prints its own lines there), and the
    previous run left where it was. Until `mint train` called preflight, the cases of stage "preflight" started Ray
    and moved the previous run aside. How fast the refusal is belongs to no test: docs/reliability.md gives figures.
    """
    _refused_by_mint_train(case, inputs, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", STARTED_CASES, ids=lambda c: c.id)
def test_input_refused_after_ray_started_is_refused_by_a_real_process_first(case, inputs, tmp_path):
    """`mint train` on each STARTED_CASES input: it started Ray and failed inside an actor (a traceback, the
    previous run moved aside), or moved the run aside before the catalog failed; now exit 2 with one line, no Ray.
    """
    _refused_by_mint_train(case, inputs, tmp_path)


def _refused_by_mint_train(case: Case, inputs: Inputs, tmp_path: Path) -> None:
    """Run `mint train` on `case`: exit 2, one stderr line, nothing on stdout, the previous run left where it was."""
    recipe, overrides = inputs.args(case)
    before = _snapshot(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(inputs.dir), str(ROOT)]), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mint.cli", "train", str(recipe), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # generous: a kill would orphan the Ray processes of a run that did start
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("mint: "), proc.stderr[-3000:]
    _check_message(case, lines[0].removeprefix("mint: config error: "), recipe)
    assert proc.stdout == ""
    assert _snapshot(tmp_path) == before, "the previous run directory changed"


def _config(inputs: Inputs, *overrides: str):
    return load_config(inputs.dir / "recipe.toml", [*overrides, f"logging.root={inputs.root}"])


def test_valid_tiny_recipe_passes(inputs, tiny_base, tmp_path):
    before = _snapshot(tmp_path)
    result = preflight(_config(inputs))
    assert result == Preflight(
        model_path=tiny_base,
        tiny_family="qwen3_moe",
        max_positions=256,
        vocab_size=384,
        prompts_checked=SYNTHETIC_BATCHES * 2,
        longest_prompt=result.longest_prompt,
        prompts_over_limit=0,
        seconds=result.seconds,
    )
    assert 15 < result.longest_prompt < 40
    assert preflight(_config(inputs)).model_path == tiny_base  # a second check finds the cached base
    assert pickle.loads(pickle.dumps(result)) == result
    assert _snapshot(tmp_path) == before


def test_truncate_prompts_lets_a_long_prompt_through(inputs):
    result = preflight(_config(inputs, f"data.source={inputs.dir}/long.jsonl", "data.truncate_prompts=true"))
    assert (result.prompts_checked, result.longest_prompt, result.prompts_over_limit) == (2, 1015, 1)


def test_system_prompt_counts_toward_the_length(inputs):
    plain = preflight(_config(inputs, f"data.source={inputs.dir}/long.jsonl", "data.truncate_prompts=true"))
    longer = preflight(
        _config(
            inputs,
            f"data.source={inputs.dir}/long.jsonl",
            "data.truncate_prompts=true",
            "data.system_prompt=You are a helpful assistant.",
        )
    )
    assert longer.longest_prompt > plain.longest_prompt


def test_a_local_model_directory_and_a_single_token_stop_pass(inputs, tiny_base):
    result = preflight(_config(inputs, f"model.path={tiny_base}", "rollout.stop_tokens=['<|im_end|>']"))
    assert (result.model_path, result.tiny_family, result.max_positions) == (tiny_base, None, 256)


def test_a_tiny_base_not_built_yet_is_checked_without_building_it(inputs, tmp_path, monkeypatch):
    """The ~20 s build belongs to the run; preflight builds the tokenizer in memory and reads the tiny config."""
    cache = tmp_path / "empty_cache"
    cache.mkdir()
    monkeypatch.setenv("MINT_CACHE", str(cache))
    result = preflight(_config(inputs))
    assert (result.model_path, result.tiny_family, result.max_positions, result.vocab_size) == (
        "tiny:qwen3_moe",
        "qwen3_moe",
        256,
        384,
    )
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.path=tiny:llama", "model.path: unknown tiny family 'llama'"),
        ("model.path=mint-test-org/no-such-model", "is not a local directory, nor a hub id in the local Hugging Face"),
        ("model.path=./no/such/dir", "model.path: ./no/such/dir does not exist"),
        ("model.path={inputs}/recipe.toml", "is a file; give the model's directory"),
        ("rollout.max_tokens=256", "rollout.max_tokens: 256 leaves no room for a prompt in the model's 256 positions"),
        (f"data.reward={REWARD_MODULE}:words", "TypeError: returned str, not a number (on the first example"),
        ("data.source=synthetic:nope", "data.source: unknown synthetic task 'nope'"),
        ("data.source={inputs}/missing.jsonl", "data.source: {inputs}/missing.jsonl: no such dataset file"),
        ("data.prompt_key=question", "data.source: {inputs}/long.jsonl: line 1: record has no 'question' key"),
        ("env.name=nope", "env.name: unknown environment 'nope'; built-in: "),
        ("env.name=mint.envs.retry:nope", "env.name: cannot load 'mint.envs.retry:nope'"),
        ("env.name=retry", "env.max_tokens: 256 leaves no room for a prompt in the model's 256 positions"),
    ],
)
def test_more_inputs_refused(inputs, override, message):
    overrides = [override.replace("{inputs}", str(inputs.dir))]
    if override.startswith("data.prompt_key"):
        overrides.append(f"data.source={inputs.dir}/long.jsonl")
    if override == "env.name=retry":  # an episode's tail needs room as a response does
        overrides.append("env.max_tokens=256")
    with pytest.raises(ConfigError) as err:
        preflight(_config(inputs, *overrides))
    assert message.replace("{inputs}", str(inputs.dir)) in str(err.value) and "\n" not in str(err.value)


def _model_dir(inputs: Inputs, tiny_base: str, drop_key: str = "", tokenizer: bool = True) -> Path:
    d = inputs.dir / "model"
    d.mkdir()
    config = json.loads((Path(tiny_base) / "config.json").read_text())
    config.pop(drop_key, None)
    (d / "config.json").write_text(json.dumps(config))
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (d / name).write_bytes((Path(tiny_base) / name).read_bytes())
    return d


def test_a_model_dir_without_tokenizer_files_is_refused(inputs, tiny_base):
    d = _model_dir(inputs, tiny_base, tokenizer=False)
    with pytest.raises(ConfigError, match=r"^model.path: .* has no tokenizer files"):
        preflight(_config(inputs, f"model.path={d}"))


def test_a_config_without_max_positions_is_refused(inputs, tiny_base):
    d = _model_dir(inputs, tiny_base, drop_key="max_position_embeddings")
    with pytest.raises(ConfigError, match=r"^model.path: .*config.json has no max_position_embeddings"):
        preflight(_config(inputs, f"model.path={d}"))


def test_a_tokenizer_larger_than_the_model_vocab_is_refused(inputs, tiny_base):
    d = _model_dir(inputs, tiny_base)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(ConfigError, match=r"^model.path: the tokenizer has 384 tokens but the model's vocab_size is 1"):
        preflight(_config(inputs, f"model.path={d}"))


def test_preflight_starts_no_ray_in_a_fresh_interpreter(inputs, tmp_path):
    """Ray is imported only once preflight has passed; preflight itself needs no cluster."""
    probe = (
        "import sys; from mint.config import load_config; from mint.train.preflight import preflight; "
        f"r = preflight(load_config({str(inputs.dir / 'recipe.toml')!r}, ['logging.root={inputs.root}'])); "
        "print('ray' in sys.modules)"
    )
    before = _snapshot(tmp_path)
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"] and out.stderr == "", out.stderr
    assert _snapshot(tmp_path) == before


def test_build_config_alone_does_not_run_preflight():
    """Config validation stays standard-library only: a missing model is preflight's business, not build_config's."""
    assert build_config({}, ["model.path=/nonexistent/x"]).model.path == "/nonexistent/x"


def _fp16(config):
    """`config` with model.dtype = float16 on its CPU learner, which load_config refuses on its own (a GPU learner is
    what fp16 is for); preflight is the check for a learner that runs on CPU anyway."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="float16"))


def test_fp16_on_a_cpu_without_fp16_is_refused(inputs, monkeypatch):
    """model.dtype = float16 with the learner on a CPU that DeepSpeed finds without fp16 support (no AVX-512-FP16 or
    AMX): the learner's deepspeed.initialize raised "Type fp16 is not supported on your device" after Ray started.
    The detector is patched here; what this machine's CPU reports is the test below."""
    monkeypatch.setattr(preflight_module, "cpu_fp16_supported", lambda: False)
    with pytest.raises(ConfigError) as err:
        preflight(_fp16(_config(inputs)))
    message = str(err.value)
    assert message.startswith("model.dtype: float16 on a CPU learner needs fp16 support") and "\n" not in message


def test_fp16_on_a_cpu_with_fp16_passes(inputs, monkeypatch):
    monkeypatch.setattr(preflight_module, "cpu_fp16_supported", lambda: True)
    assert preflight(_fp16(_config(inputs))).prompts_checked == SYNTHETIC_BATCHES * 2


def test_the_fp16_detector_agrees_with_deepspeed():
    """cpu_fp16_supported makes DeepSpeed's own CPU check without importing deepspeed (whose import logs a line)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert cpu_fp16_supported() == bool(CPU_Accelerator().is_fp16_supported())


def test_an_eval_prompt_too_long_passes_under_truncate_prompts(inputs):
    result = preflight(_config(inputs, f"eval.source={inputs.dir}/long.jsonl", "data.truncate_prompts=true"))
    assert result.prompts_over_limit == 0  # the training prompts; the long eval prompt will be cut


def test_an_eval_prompt_past_eval_max_prompts_is_not_checked(inputs):
    """Only the first eval.max_prompts records are evaluated (record 1 is the long one)."""
    preflight(_config(inputs, f"eval.source={inputs.dir}/long.jsonl", "eval.max_prompts=1"))


def test_the_rollout_actor_cuts_or_refuses_a_prompt_with_the_preflight_check(inputs):
    """The actor's guard on each prompt it samples (a synthetic stream's later draws) is the same function: it names
    the key of the prompt's source, eval.source for an eval prompt (it said data.source for every prompt)."""
    config = _config(inputs)
    with pytest.raises(
        ConfigError, match=r"^eval.source: a prompt is 300 tokens with the chat template, over the 248 "
    ):
        check_prompt_lengths("eval.source", [300], 248, config)
    assert check_prompt_lengths("data.source", [248], 248, config) == 0
    truncating = _config(inputs, "data.truncate_prompts=true")
    assert check_prompt_lengths("data.source", [300], 248, truncating) == 1


def test_a_new_catalog_directory_passes_and_is_not_made(inputs):
    catalog = inputs.root / "shared" / "catalog"
    preflight(_config(inputs, f"catalog.path={catalog}"))
    assert not catalog.parent.exists()


def test_a_chat_template_that_rewrites_earlier_turns_is_refused_for_episodes(inputs, tiny_base):
    """A template that renders only the last two messages (as templates that drop past reasoning rewrite the past)
    would show a later turn a context its earlier turns did not have; env.name refuses it in one line."""
    d = _model_dir(inputs, tiny_base)
    rewriting = (
        "{%- for message in messages[-2:] %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    (d / "chat_template.jinja").write_text(rewriting)
    preflight(_config(inputs, f"model.path={d}"))  # one response per prompt: fine
    with pytest.raises(ConfigError, match=r"^env.name: the chat template rewrites earlier text when message 3"):
        preflight(_config(inputs, f"model.path={d}", "env.name=retry"))
