"""Recipes: loading, overrides, one-line errors with exit code 2, and docs/configuration.md kept in sync."""

import dataclasses
import pickle
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from mint.cli import main
from mint.config import (
    SECTIONS,
    Config,
    ConfigError,
    LearnerConfig,
    all_keys,
    build_config,
    config_markdown,
    load_config,
)
from mint.config.rules import COMBINATIONS
from mint.config.schema import RENAMED

ROOT = Path(__file__).resolve().parents[1]


def test_every_recipe_loads():
    recipes = sorted((ROOT / "recipes").glob("*.toml"))
    assert recipes, "no recipes found"
    for recipe in recipes:
        config = load_config(recipe)
        assert isinstance(config, Config)
        assert "mint train" in recipe.read_text().splitlines()[1], f"{recipe.name}: header must give the launch command"


def test_overrides_parse_as_toml_and_strings_need_no_quotes():
    config = build_config(
        {},
        [
            "grpo.kl_coef=0.05",
            "model.path=org/some-model",
            "rollout.stop_tokens=['</a>']",
            "grpo.scale_std=false",
            "learner.lr=1",
        ],
    )
    assert config.grpo.kl_coef == 0.05
    assert config.model.path == "org/some-model"
    assert config.rollout.stop_tokens == ["</a>"]
    assert config.grpo.scale_std is False
    assert config.learner.lr == 1.0 and isinstance(config.learner.lr, float)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("grpo.bogus_key=1", "grpo.bogus_key: unknown key"),
        ("grpo.kl_coeff=0.1", "grpo.kl_coeff: unknown key (did you mean grpo.kl_coef?)"),
        ("rollot.group_size=4", "rollot.group_size: unknown key (did you mean rollout.group_size?)"),
        ("learner.zero_stage=4", "learner.zero_stage: 4 is above the maximum 3"),
        ("rollout.group_size=1", "rollout.group_size: 1 is below the minimum 2"),
        ("rollout.temperature=0", "rollout.temperature: 0.0 must be greater than 0.0"),
        ("learner.lr=fast", "learner.lr: expected a number, got 'fast'"),
        ("grpo.steps=2.5", "grpo.steps: expected an integer, got 2.5"),
        ("grpo.scale_std=1", "grpo.scale_std: expected true or false, got 1"),
        ("grpo.loss_agg=sum", "grpo.loss_agg: 'sum' is not one of token-mean, seq-mean-token-mean, constant"),
        ("lora.target_modules=q_proj", "lora.target_modules: expected a list of strings"),
        ("justtext", "justtext: an override must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    message = str(err.value)
    assert message.startswith(expected)
    assert "\n" not in message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["learner.inner_step=longstraw", "learner.zero_stage=3"],
            "learner.inner_step: longstraw runs the model piecewise",
        ),
        (["model.dtype=float16"], "model.dtype: float16 needs a GPU learner"),
        # ZeRO-2 reduces inside every backward; LongStraw's backward count differs across ranks.
        (
            ["learner.inner_step=longstraw", "learner.zero_stage=2", "learner.num_ranks=2"],
            "learner.zero_stage: 2 reduces",
        ),
        # DeepSpeed's stage-0 fp16 optimizer never scales the loss in engine.backward.
        (
            ["model.dtype=float16", "ray.learner_gpus=1", "learner.zero_stage=0"],
            "model.dtype: float16 needs learner.zero_stage >= 1",
        ),
    ],
)
def test_combinations_that_are_not_correct_are_refused(overrides, expected):
    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    build_config({}, ["model.dtype=float16", "ray.learner_gpus=1", "learner.zero_stage=1"])  # the supported ones
    build_config({}, ["learner.inner_step=longstraw", "learner.zero_stage=2", "learner.num_ranks=1"])


def test_bad_recipe_table_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[grpo]\nsteps = 'many'\n")
    with pytest.raises(ConfigError, match=r"^grpo.steps: expected an integer"):
        load_config(bad)
    bad.write_text("grpo = 3\n")
    with pytest.raises(ConfigError, match=r"^grpo: expected a \[grpo\] table"):
        load_config(bad)
    bad.write_text("[grpo\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="recipe not found"):
        load_config(tmp_path / "nope.toml")


def test_cli_bad_key_exits_2_with_one_line(capsys):
    code = main(["train", str(ROOT / "recipes/smoke.toml"), "grpo.bogus_key=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "grpo.bogus_key" in err


def test_cli_bad_key_as_a_real_process():
    """The acceptance check, as a user runs it: exit 2, one line on stderr, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "mint.cli", "train", "recipes/smoke.toml", "grpo.bogus_key=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "grpo.bogus_key" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_config_is_frozen_and_pickles():
    config = build_config({}, ["grpo.steps=3"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.grpo.steps = 4  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.digest() == pickle.loads(pickle.dumps(config)).digest()
    assert config.digest() != build_config({}, ["grpo.steps=4"]).digest()


def test_every_field_has_help():
    for key in all_keys():
        section, name = key.split(".")
        f = next(f for f in dataclasses.fields(getattr(Config(), section)) if f.name == name)
        assert f.metadata.get("help"), f"{key} has no help string"


def test_configuration_doc_in_sync():
    doc = (ROOT / "docs/configuration.md").read_text()
    assert doc.strip() == config_markdown().strip(), "regenerate with: make docs"
    for key in all_keys():
        assert f"`{key}`" in doc


# A drill found learner.lr=nan, lr=inf and rollout.temperature=nan accepted (NaN is neither < nor > any
# bound), recipes that are a directory or a binary file failing with a traceback, an empty recipe running on all
# defaults, and an empty logging.name moving the whole runs/ folder aside.

FLOAT_KEYS = [
    f"{section}.{f.name}"
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if typing.get_type_hints(cls)[f.name] is float
]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+inf"])
def test_every_float_key_refuses_non_finite_overrides(value):
    assert len(FLOAT_KEYS) >= 15, FLOAT_KEYS
    shown = {"nan": "nan", "inf": "inf", "+inf": "inf", "-inf": "-inf"}[value]
    for key in FLOAT_KEYS:
        with pytest.raises(ConfigError) as err:
            build_config({}, [f"{key}={value}"])
        assert str(err.value) == f"{key}: {shown} is not a finite number"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_floats_in_a_recipe_are_refused(tmp_path, value):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[learner]\nlr = 1e-3\n\n[rollout]\ntemperature = {value}\n")
    with pytest.raises(ConfigError, match=rf"^rollout.temperature: {value} is not a finite number$"):
        load_config(recipe)


def test_large_finite_floats_still_meet_the_range_checks():
    with pytest.raises(ConfigError, match=r"^learner.lr: 1e\+300 is above the maximum 1.0$"):
        build_config({}, ["learner.lr=1e300"])
    assert build_config({}, ["grpo.eps_high=1e300"]).grpo.eps_high == 1e300


def test_recipe_that_is_a_directory_binary_or_empty(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read the recipe \(.*\); give a TOML file$"):
        load_config(tmp_path)
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(a binary file\?\)"):
        load_config(binary)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("[logging]\nname = 'caf\xe9'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(latin1)
    for text in ("", "\n\n", "# only a comment\n"):
        empty = tmp_path / "empty.toml"
        empty.write_text(text)
        with pytest.raises(ConfigError, match=r"the recipe is empty \(no \[section\] table\)"):
            load_config(empty)
    one_table = tmp_path / "one_table.toml"
    one_table.write_text("[grpo]\n")  # a table, even empty, is a recipe: the rest is defaults
    assert load_config(one_table) == Config()


def test_recipe_file_errors_exit_2_with_one_line(tmp_path, capsys):
    for recipe in (tmp_path, tmp_path / "empty.toml"):
        (tmp_path / "empty.toml").write_text("")
        assert main(["train", str(recipe)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"mint: config error: {recipe}: "), err


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/abs", "x/..", "a b", "run\\1", "caf\u00e9", "r\n"])
def test_logging_name_must_be_a_plain_folder_name(name):
    with pytest.raises(ConfigError) as err:
        build_config({"logging": {"name": name}})
    assert str(err.value) == f"logging.name: {name!r} is not a plain folder name (letters, digits, '.', '_', '-')"
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["mint", "smoke-v2", "run_1.b", ".hidden", "a..b", "-x"])
def test_plain_logging_names_pass(name):
    assert build_config({}, [f"logging.name={name}"]).logging.name == name


@pytest.mark.parametrize("root", ["", "  "])
def test_logging_root_must_not_be_empty(root):
    with pytest.raises(ConfigError, match=r"^logging.root: is empty"):
        build_config({"logging": {"root": root}})


def test_a_recipe_builds_on_another_key_by_key(tmp_path):
    """`base = "other.toml"` loads the other recipe first (recursively, relative to the recipe's folder);
    the recipe's keys override it one by one, sections it does not name are inherited whole, overrides come last."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.toml").write_text("[grpo]\nsteps = 7\nseed = 3\n[rollout]\ngroup_size = 4\n")
    (tmp_path / "sub/mid.toml").write_text('base = "../root.toml"\n[grpo]\nsteps = 9\n[logging]\nname = "mid"\n')
    (tmp_path / "leaf.toml").write_text('base = "sub/mid.toml"\n[grpo]\nseed = 5\n')
    config = load_config(tmp_path / "leaf.toml", ["rollout.group_size=6"])
    assert (config.grpo.steps, config.grpo.seed, config.logging.name) == (9, 5, "mid")
    assert config.rollout.group_size == 6 and config.rollout.max_tokens == Config().rollout.max_tokens

    arith, smoke = load_config(ROOT / "recipes/arithmetic_cpu.toml"), load_config(ROOT / "recipes/smoke.toml")
    assert arith.lora == smoke.lora and arith.model == smoke.model and arith.rollout == smoke.rollout
    assert (arith.learner.num_ranks, smoke.learner.num_ranks, arith.data.reward) == (1, 2, "math_verify")


@pytest.mark.parametrize(
    "files, match",
    [
        ({"a.toml": 'base = "b.toml"\n[grpo]\nsteps = 1\n', "b.toml": 'base = "a.toml"\n'}, "includes itself"),
        ({"a.toml": 'base = "a.toml"\n'}, "includes itself"),
        ({"a.toml": 'base = "missing.toml"\n'}, "missing.toml: recipe not found"),
        ({"a.toml": "base = 3\n"}, "base: expected the path of another recipe"),
        ({"a.toml": 'base = "b.toml"\n[grpo]\nstepz = 1\n', "b.toml": "[grpo]\nsteps = 2\n"}, "grpo.stepz: unknown"),
    ],
)
def test_bad_base_chains_fail_with_one_line(tmp_path, files, match):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        load_config(tmp_path / "a.toml")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("overrides", "ok", "why"), COMBINATIONS, ids=[" ".join(c[0]) for c in COMBINATIONS])
def test_the_combinations_table_is_what_the_loader_does(overrides, ok, why):
    if ok:
        build_config({}, list(overrides))
    else:
        with pytest.raises(ConfigError) as err:
            build_config({}, list(overrides))
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(("old", "new"), RENAMED.items())
def test_an_old_key_names_its_new_one_in_a_recipe_and_an_override(tmp_path, old, new):
    section, _, name = old.partition(".")
    recipe = tmp_path / "old.toml"
    recipe.write_text(f"[{section}]\n{name} = 1\n")
    expected = f"{old}: this key is now {new} (same meaning); rename it in the recipe"
    for call in (lambda: load_config(recipe), lambda: build_config({}, [f"{old}=1"])):
        with pytest.raises(ConfigError) as err:
            call()
        assert str(err.value) == expected


def test_modes_are_literal_types_and_the_loader_takes_their_values_from_them():
    assert typing.get_args(typing.get_type_hints(LearnerConfig)["inner_step"]) == ("longstraw", "naive")
    with pytest.raises(ConfigError, match=r"^longstraw\.mode: 'fast' is not one of exact, detached, resident$"):
        build_config({}, ["longstraw.mode=fast"])
    with pytest.raises(ConfigError, match=r"^rollout\.backend: 3 is not one of builtin, vllm, sglang$"):
        build_config({"rollout": {"backend": 3}})


def test_top_p_under_1_with_the_vllm_backend_is_refused_naming_the_key():
    """rollout.top_p = 0.9 with rollout.backend = vllm was accepted, though vLLM's logprobs are then those of the
    truncated nucleus and the learner's of the whole softmax, so the ratio was off on every token. One line naming
    rollout.top_p; top_p = 1 with vLLM, and top_p < 1 with the builtin and SGLang backends, still load."""
    engines = ["engines.urls=['http://h:8000']"]
    with pytest.raises(ConfigError) as err:
        build_config({}, ["rollout.backend=vllm", *engines, "rollout.top_p=0.9"])
    assert str(err.value).startswith("rollout.top_p: 0.9 < 1 with rollout.backend = vllm") and "\n" not in str(
        err.value
    )
    build_config({}, ["rollout.backend=vllm", *engines, "rollout.top_p=1.0"])
    build_config({}, ["rollout.backend=sglang", *engines, "rollout.top_p=0.9"])
    build_config({}, ["rollout.top_p=0.9"])
