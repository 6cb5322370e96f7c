"""Recipes: TOML files loaded into frozen dataclasses, with dotted `key=value` overrides.

Every field has a default and a help string, and is validated at load. A bad recipe or override raises `ConfigError`
with one line that names the dotted key (and the closest valid key when there is one); the CLI prints that line and
exits with code 2. Nothing rewrites a config in place: derived values come from pure functions.

    schema.py   the sections of what a step computes, and Config (RESULT_NEUTRAL)
    sections.py the sections of where and how a run runs, logs and checkpoints
    knobs.py    `knob`, how a field is declared
    load.py     load_config / build_config, range checks, derived values (run_dir, norm_constant)
    rules.py    every rule that involves more than one key
    doc.py      docs/configuration.md (`python -m mint.config`)
"""

from mint.config.doc import config_markdown
from mint.config.load import build_config, load_config, norm_constant, response_room, run_dir
from mint.config.schema import (
    RESULT_NEUTRAL,
    SECTIONS,
    CatalogConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EnginesConfig,
    EnvConfig,
    EvalConfig,
    GrpoConfig,
    LearnerConfig,
    LoggingConfig,
    LongStrawConfig,
    LoraConfig,
    ModelConfig,
    RayConfig,
    RolloutConfig,
    all_keys,
    knob,
)
from mint.errors import ConfigError

__all__ = [
    "RESULT_NEUTRAL",
    "SECTIONS",
    "CatalogConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnginesConfig",
    "EnvConfig",
    "EvalConfig",
    "GrpoConfig",
    "LearnerConfig",
    "LoggingConfig",
    "LongStrawConfig",
    "LoraConfig",
    "ModelConfig",
    "RayConfig",
    "RolloutConfig",
    "all_keys",
    "build_config",
    "config_markdown",
    "knob",
    "load_config",
    "norm_constant",
    "response_room",
    "run_dir",
]
