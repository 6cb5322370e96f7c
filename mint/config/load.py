"""Loading and validating recipes: TOML plus dotted overrides into a `Config`, or one `ConfigError` line."""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from pathlib import Path
from typing import Any

from mint.config.rules import recipe_rules
from mint.config.schema import RENAMED, SECTIONS, Config, all_keys, choices
from mint.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" (did you mean {match[0]}?)" if match else ""


def _type_name(tp) -> str:
    if choices(tp):
        return "one of " + ", ".join(choices(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, "a list of strings")


def _check_value(key: str, tp, meta: dict, value: Any) -> Any:
    """Type- and range-check one value; returns it converted (int -> float where a float is expected)."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    allowed = choices(tp)
    if allowed:
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
        return value
    if typing.get_origin(tp) is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    elif not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is float and not math.isfinite(value):  # NaN compares false with every bound, so the range checks pass it
        raise ConfigError(f"{key}: {value!r} is not a finite number")
    if meta["min"] is not None and value < meta["min"]:
        raise ConfigError(f"{key}: {value!r} is below the minimum {meta['min']}")
    if meta["max"] is not None and value > meta["max"]:
        raise ConfigError(f"{key}: {value!r} is above the maximum {meta['max']}")
    if meta["gt"] is not None and value <= meta["gt"]:
        raise ConfigError(f"{key}: {value!r} must be greater than {meta['gt']}")
    return value


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{section}.{name}"
        _refuse_renamed(key)
        if name not in fields:
            raise ConfigError(f"{key}: unknown key{_closest(key, all_keys())}")
        kwargs[name] = _check_value(key, hints[name], fields[name].metadata, value)
    return cls(**kwargs)


def _refuse_renamed(key: str) -> None:
    if key in RENAMED:
        raise ConfigError(f"{key}: this key is now {RENAMED[key]} (same meaning); rename it in the recipe")


def _parse_override(item: str) -> tuple[str, str]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{item}: an override must look like section.key=value")
    return key.strip(), raw.strip()


def _override_value(key: str, raw: str) -> Any:
    """Parse an override's value as TOML (1, 0.5, true, ["a"]), falling back to the raw text for strings."""
    section, _, name = key.partition(".")
    tp = typing.get_type_hints(SECTIONS[section]).get(name)
    if tp is str and not raw.startswith(('"', "'")):
        return raw  # a path or hub id needs no quotes on the command line
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def build_config(tree: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Validate a parsed recipe plus dotted overrides into a Config. Raises ConfigError naming the key."""
    merged: dict[str, dict[str, Any]] = {}
    for section, values in tree.items():
        if section == "mint" and isinstance(values, dict):  # the [mint] section is now [catalog]
            for name in values:
                _refuse_renamed(f"mint.{name}")
        if section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section{_closest(section, list(SECTIONS))}")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {values!r}")
        merged[section] = dict(values)
    for item in overrides:
        key, raw = _parse_override(item)
        _refuse_renamed(key)
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise ConfigError(f"{key}: unknown key{_closest(key, all_keys())}")
        merged.setdefault(section, {})[name] = _override_value(key, raw) if name in _field_names(section) else raw
    config = Config(**{s: _build_section(s, SECTIONS[s], merged.get(s, {})) for s in SECTIONS})
    recipe_rules(config)
    return config


def _field_names(section: str) -> set[str]:
    return {f.name for f in dataclasses.fields(SECTIONS[section])}


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Load a TOML recipe (a UTF-8 file with at least one table) and apply `section.key=value` overrides.

    A recipe may build on another: a top-level `base = "other.toml"` (relative to the recipe's folder) is loaded
    first, recursively, and the recipe's keys override it key by key within each section; then the overrides apply.
    The run's config.json holds the resolved result.
    """
    return build_config(_resolved_tree(Path(path), ()), overrides)


def _resolved_tree(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """The recipe at `path` merged over its `base` chain (`chain`: the recipes that asked for it, for cycles)."""
    tree = _read_recipe(path)
    base = tree.pop("base", None)
    if base is None:
        if not tree:
            raise ConfigError(f"{path}: the recipe is empty (no [section] table); start from recipes/smoke.toml")
        return tree
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: base: expected the path of another recipe, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in chain or base_path == path.resolve():
        raise ConfigError(f"{path}: base: {base} includes itself (a cycle through {base_path.name})")
    merged = _resolved_tree(base_path, (*chain, path.resolve()))
    for section, values in tree.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values  # build_config names what is wrong with a non-table
    return merged


def _read_recipe(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe not found") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text (a binary file?); a recipe is a TOML file") from None
    except OSError as e:  # a directory, a file we may not read
        raise ConfigError(f"{path}: cannot read the recipe ({e.strerror}); give a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def run_dir(config: Config) -> Path:
    """Where a run writes metrics, adapters and the resolved config."""
    return Path(config.logging.root) / config.logging.name


def norm_constant(config: Config) -> int:
    """Dr.GRPO's constant normalizer per response: the most tokens carrying loss a response may have (an episode's:
    its actions', at most max_turns of rollout.max_tokens within the tail's env.max_tokens)."""
    if config.env.name:
        return min(config.env.max_tokens, config.env.max_turns * config.rollout.max_tokens)
    return config.rollout.max_tokens


def response_room(config: Config) -> tuple[str, int]:
    """(key, tokens): the positions a prompt must leave free, a response's (rollout.max_tokens) or an episode's tail
    after its initial observation (env.max_tokens); the rollout actors cut prompts to fit and preflight checks."""
    if config.env.name:
        return "env.max_tokens", config.env.max_tokens
    return "rollout.max_tokens", config.rollout.max_tokens
