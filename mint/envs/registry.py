"""`env.name`: a built-in environment's name, or `pkg.module:fn` for one of the user's."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mint.errors import ConfigError

BUILT_IN = {
    "retry": "mint.envs.retry:retry",
    "python": "mint.envs.python_tool:python",
    "lookup": "mint.envs.lookup:lookup",
}


def resolve_env(name: str) -> Callable:
    """The group-builder factory `name` names: called as fn(example, tokenizer, config, prompt_ids, stop) for each
    prompt, it returns the EnvGroupBuilder of that prompt's G episodes. ConfigError (one line) when it cannot be
    found."""
    spec = BUILT_IN.get(name, name)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(
            f"env.name: unknown environment {name!r}; built-in: {', '.join(sorted(BUILT_IN))}, or pkg.module:fn"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"env.name: cannot load {spec!r}: {err}") from None
    if not callable(factory):
        raise ConfigError(f"env.name: {spec!r} is not callable")
    return factory


def check_environment(name: str, tokenizer) -> None:
    """Preflight for `env.name`: the factory loads, and the tokenizer's chat template is append-only, so the
    observations an environment renders as deltas are the context the policy will see (mint.envs.chat). One line
    (ConfigError) otherwise."""
    from mint.envs.chat import TemplateNotAppendOnly, check_append_only

    resolve_env(name)
    try:
        check_append_only(tokenizer)
    except TemplateNotAppendOnly as err:
        raise ConfigError(f"env.name: {err}") from None
