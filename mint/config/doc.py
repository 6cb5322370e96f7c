"""docs/configuration.md, generated from the schema: `python -m mint.config > docs/configuration.md`."""

from __future__ import annotations

import dataclasses
import json
import types
import typing

from mint.config.rules import COMBINATIONS
from mint.config.schema import RENAMED, SECTIONS, choices


def config_markdown() -> str:
    """docs/configuration.md, generated from the dataclasses (a test keeps the file in sync)."""
    lines = [
        "# Configuration",
        "",
        "Recipes are TOML files with one table per section. Any key can be overridden on the command line with a",
        "dotted `section.key=value` (values parse as TOML; strings need no quotes). An unknown key, a wrong type or a",
        "value out of range stops the run with one line naming the key, and exit code 2.",
        "",
        "This page is generated from `mint/config/schema.py` by `python -m mint.config > docs/configuration.md`;",
        "a test fails when they drift apart.",
        "",
    ]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        lines += [f"## [{section}]", "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(
                f"| `{section}.{f.name}` | {_short_type(hints[f.name])} | `{json.dumps(default)}` "
                f"| {_allowed(hints[f.name], f.metadata)} | {f.metadata['help']} |"
            )
        lines.append("")
    lines += [
        "## Valid combinations",
        "",
        "Rules across keys live in `mint/config/rules.py`. Each row sets these keys over the defaults; a test builds",
        "every row, so the table says what the loader does.",
        "",
        "| keys | allowed | why |",
        "|---|---|---|",
    ]
    for overrides, ok, why in COMBINATIONS:
        lines.append(f"| {', '.join(f'`{o}`' for o in overrides)} | {'yes' if ok else 'no'} | {why} |")
    lines += [
        "",
        "## Renamed keys",
        "",
        "A recipe or override that names an old key stops with one line naming the new one.",
        "",
        "| old | new |",
        "|---|---|",
        *(f"| `{old}` | `{new}` |" for old, new in RENAMED.items()),
        "",
    ]
    return "\n".join(lines)


def _short_type(tp) -> str:
    if choices(tp):
        return "str"
    return tp.__name__ if isinstance(tp, type) and not isinstance(tp, types.GenericAlias) else "list[str]"


def _allowed(tp, meta: dict) -> str:
    if choices(tp):
        return ", ".join(f"`{c}`" for c in choices(tp))
    parts = []
    if meta["gt"] is not None:
        parts.append(f"> {meta['gt']}")
    if meta["min"] is not None:
        parts.append(f">= {meta['min']}")
    if meta["max"] is not None:
        parts.append(f"<= {meta['max']}")
    return ", ".join(parts) or "any"
