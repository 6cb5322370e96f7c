"""Tool calls as each model family writes them: declare a tool, render a call, parse a turn, check the arguments.

A policy in a multi-turn environment calls tools in the format its family was post-trained on, so the environment
has to read that format, and the supervised data that teaches a tiny model to call tools has to be written in it.
Each format is read off the chat template that writes it and the parser vLLM serves that family with;
tests/test_tool_calls.py checks that vLLM's own parsers read what `render_turn` writes into the same calls.

- `parse_tool_calls(format, text, tools)` splits a turn into its content and its `ToolCall`s. A malformed turn (an
  unclosed or stray marker, bad JSON, arguments that are not an object, a tool not in `tools`) gives one line in
  `error` and no calls: a half-read turn must not run half of its calls. Where vLLM guesses (a Hermes call left
  unclosed at the end of a turn) or drops a call without a word (GLM's call of an unknown tool), this is an error:
  the policy should learn the format, and the environment should say what went wrong.
- The XML-like formats (qwen3_coder, glm45/glm47) write values as bare text, so their values are typed by the
  tool's schema, as vLLM types them; without `tools` they stay strings.
- `check_arguments(tool, call)` is a separate step, so an environment can tell a turn it could not read from a call
  it read but cannot run: required keys, additionalProperties: false, enum and the basic JSON types, which is what
  tools' schemas say in practice (a full JSON-schema validator would be a dependency for no gain).

Standard library only: an environment's process should not import torch or an engine to read text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tool:
    """A function tool; parameters is a JSON-schema object: {"type": "object", "properties": ..., "required": ...}."""

    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedTurn:
    """content: the turn's text outside its calls, stripped (all of it when the turn has an error); error: one line
    on why the turn could not be read, and then calls is empty."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None


class _Malformed(Exception):
    """Why a turn cannot be read, in one line; parse_tool_calls turns it into ParsedTurn.error."""


_ByName = dict[str, Tool] | None  # the tools of a parse, by name


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes a turn's calls: `content + lead + section[0] + inner + calls joined by sep + inner +
    section[1]`, each call `open + body(call, index in the turn) + close`; `section` only where the format wraps a
    turn's calls. `read` parses a body back. `markers` belong inside a call only: outside one they make the turn
    malformed (a Qwen `<function=` with no `<tool_call>` around it is a call to vLLM; as text it would hide)."""

    open: str
    close: str
    body: Callable[[ToolCall, int], str]
    read: Callable[[str, _ByName], ToolCall]
    section: tuple[str, str] | None = None
    sep: str = ""
    lead: str = ""
    inner: str = ""
    markers: tuple[str, ...] = ()


# ---- values: JSON where the format writes JSON, bare text typed by the schema where it does not ----


def _json(value: object) -> str:
    # As the templates' tojson writes it: non-ASCII as is, json's default separators.
    return json.dumps(value, ensure_ascii=False)


def _json_object(raw: str, what: str) -> dict:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _Malformed(f"{what}: bad JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(value, dict):
        raise _Malformed(f"{what}: arguments are {_type_name(value)}, not an object")
    return value


_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")


def _typed(raw: str, schema: object) -> object:
    """A bare-text value as its schema's type, tried in vLLM's order (null, integer, number, boolean, object, array,
    string); text that fits none stays the string, for check_arguments to report."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = {kinds} if isinstance(kinds, str) else set(kinds or ())
    text = raw.strip()
    if "null" in kinds and text.lower() in ("null", "none"):
        return None
    if kinds & {"integer", "number"} and _NUMBER.fullmatch(text):
        number = json.loads(text)
        if isinstance(number, int) or ("number" in kinds and math.isfinite(number)):
            return number
    # Qwen's template prints a Python bool ("True"); GLM's and DeepSeek's write JSON ("true").
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kinds & {"object", "array"}:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if (isinstance(value, dict) and "object" in kinds) or (isinstance(value, list) and "array" in kinds):
            return value
    return raw


def _arguments(body: str, pattern: re.Pattern, name: str) -> list[re.Match]:
    """`pattern`'s matches in `body`, one argument each (its key the first group); `body` must hold nothing else but
    whitespace, and no key twice."""
    matches = list(pattern.finditer(body))
    rest = pattern.sub("", body).strip()
    if rest:
        raise _Malformed(f"{name}: unexpected text among the arguments: {rest[:40]!r}")
    keys = [m.group(1).strip() for m in matches]
    if twice := sorted({key for key in keys if keys.count(key) > 1}):
        raise _Malformed(f"{name}: argument {', '.join(twice)} given twice")
    return matches


def _typed_call(name: str, body: str, pattern: re.Pattern, tools: _ByName) -> ToolCall:
    tool = tools.get(name) if tools else None
    props = tool.parameters.get("properties", {}) if tool else {}
    keyed = [(m.group(1).strip(), m.group(2)) for m in _arguments(body, pattern, name)]
    return ToolCall(name, {key: _typed(value, props.get(key)) for key, value in keyed})


def _name(name: str, what: str) -> str:
    name = name.strip()
    if not name or any(c in name for c in "<>\n\"'"):
        raise _Malformed(f"{what}: bad function name {name[:40]!r}")
    return name


def _bare(value: object) -> str:
    # GLM's and DeepSeek-V3.2's templates write strings as they are and JSON-encode everything else.
    return value if isinstance(value, str) else _json(value)


# ---- hermes (Qwen3, Qwen2.5): <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> per call ----


def _hermes_body(call: ToolCall, index: int) -> str:
    return f'\n{{"name": {_json(call.name)}, "arguments": {_json(call.arguments)}}}\n'


def _hermes_read(body: str, tools: _ByName) -> ToolCall:
    call = _json_object(body, "<tool_call>")
    name, args = call.get("name"), call.get("arguments")
    if not isinstance(name, str):
        raise _Malformed('<tool_call>: no "name" string')
    if not isinstance(args, dict):
        raise _Malformed(f"{name}: arguments are {_type_name(args)}, not an object")
    return ToolCall(_name(name, "<tool_call>"), args)


# ---- qwen3_coder (Qwen3.5, Qwen3-Next, Qwen3-Coder): <function=NAME> and a <parameter=KEY> per argument ----

_QWEN_FUNCTION = re.compile(r"\s*<function=([^>]*)>(.*)</function>\s*", re.DOTALL)
# The template writes a newline on each side of a value; one is taken off each side, as vLLM does.
_QWEN_PARAMETER = re.compile(r"<parameter=([^>]*)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _qwen_body(call: ToolCall, index: int) -> str:
    # The template JSON-encodes mappings and lists and prints everything else with Jinja's `string` (Python's str).
    value = lambda v: v if isinstance(v, str) else _json(v) if isinstance(v, (dict, list)) else str(v)
    params = "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in call.arguments.items())
    return f"\n<function={call.name}>\n{params}</function>\n"


def _qwen_read(body: str, tools: _ByName) -> ToolCall:
    match = _QWEN_FUNCTION.fullmatch(body)
    if not match:
        raise _Malformed("<tool_call>: no <function=NAME>...</function> in it")
    return _typed_call(_name(match.group(1), "<function=...>"), match.group(2), _QWEN_PARAMETER, tools)


# ---- glm45 / glm47 (GLM-4.5/4.6; GLM-4.7, GLM-5): NAME, then <arg_key>K</arg_key><arg_value>V</arg_value> pairs ----

_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_body(nl: str) -> Callable[[ToolCall, int], str]:
    # GLM-4.5/4.6's template puts a newline after the name and after each tag; GLM-4.7's and GLM-5's put none.
    def body(call: ToolCall, index: int) -> str:
        args = "".join(
            f"<arg_key>{k}</arg_key>{nl}<arg_value>{_bare(v)}</arg_value>{nl}" for k, v in call.arguments.items()
        )
        return f"{call.name}{nl}{args}"

    return body


def _glm_read(body: str, tools: _ByName) -> ToolCall:
    head = body.partition("<arg_key>")[0]
    return _typed_call(_name(head, "<tool_call>"), body[len(head) :], _GLM_ARG, tools)


# ---- deepseek_v31 (DeepSeek-V3.1): NAME<｜tool▁sep｜>{json} per call, in one calls section per turn ----

_DS_SEP = "<｜tool▁sep｜>"


def _deepseek_read(body: str, tools: _ByName) -> ToolCall:
    name, sep, args = body.partition(_DS_SEP)
    if not sep:
        raise _Malformed(f"<｜tool▁call▁begin｜>: no {_DS_SEP}")
    name = _name(name, "<｜tool▁call▁begin｜>")
    return ToolCall(name, _json_object(args, name))


# ---- deepseek_v32 (DeepSeek-V3.2): DSML invoke and parameter tags; each parameter says whether it is a string ----

_DSML = "｜DSML｜"
_DSML_PARAMETER = re.compile(
    rf'<{_DSML}parameter\s+name="([^"]*)"(?:\s+string="([^"]*)")?\s*>(.*?)</{_DSML}parameter>', re.DOTALL
)


def _dsml_body(call: ToolCall, index: int) -> str:
    params = "\n".join(
        f'<{_DSML}parameter name="{k}" string="{str(isinstance(v, str)).lower()}">{_bare(v)}</{_DSML}parameter>'
        for k, v in call.arguments.items()
    )
    return f'{call.name}">\n{params}\n'


def _dsml_read(body: str, tools: _ByName) -> ToolCall:
    head, quote, rest = body.partition('">')
    if not quote:
        raise _Malformed(f'<{_DSML}invoke name="...": no closing ">')
    name = _name(head, f"<{_DSML}invoke>")
    args = {}
    for match in _arguments(rest, _DSML_PARAMETER, name):
        key, is_string, raw = match.groups()
        try:  # a value not marked as a string is JSON; one that is not JSON stays a string, as vLLM keeps it
            args[key] = raw if is_string == "true" else json.loads(raw)
        except json.JSONDecodeError:
            args[key] = raw
    return ToolCall(name, args)


# ---- kimi_k2 (Kimi-K2, K2.5): functions.NAME:INDEX<|tool_call_argument_begin|>{json} in a calls section ----

_KIMI_HEAD = re.compile(r"\s*(?:functions\.)?([^:<>\s]+):\d+\s*<\|tool_call_argument_begin\|>(.*)", re.DOTALL)


def _kimi_read(body: str, tools: _ByName) -> ToolCall:
    match = _KIMI_HEAD.fullmatch(body)
    if not match:
        raise _Malformed("<|tool_call_begin|>: no functions.NAME:INDEX<|tool_call_argument_begin|> header")
    return ToolCall(match.group(1), _json_object(match.group(2), match.group(1)))


_TC = ("<tool_call>", "</tool_call>")
_QWEN_MARKERS = ("<function=", "</function>", "<parameter=", "</parameter>")
_GLM_MARKERS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(*_TC, _hermes_body, _hermes_read, sep="\n", lead="\n"),
    "qwen3_coder": ToolCallFormat(*_TC, _qwen_body, _qwen_read, sep="\n", lead="\n\n", markers=_QWEN_MARKERS),
    "glm45": ToolCallFormat(*_TC, _glm_body("\n"), _glm_read, sep="\n", lead="\n", markers=_GLM_MARKERS),
    "glm47": ToolCallFormat(*_TC, _glm_body(""), _glm_read, markers=_GLM_MARKERS),
    "deepseek_v31": ToolCallFormat(
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        lambda call, index: f"{call.name}{_DS_SEP}{_json(call.arguments)}",
        _deepseek_read,
        section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
        markers=(_DS_SEP,),
    ),
    "deepseek_v32": ToolCallFormat(
        f'<{_DSML}invoke name="',
        f"</{_DSML}invoke>",
        _dsml_body,
        _dsml_read,
        section=(f"<{_DSML}function_calls>", f"</{_DSML}function_calls>"),
        sep="\n",
        lead="\n\n",
        inner="\n",
        markers=(f"<{_DSML}parameter", f"</{_DSML}parameter>"),
    ),
    # Kimi numbers its calls across the whole conversation; a turn rendered alone numbers its own from 0, and the
    # number is not read back (vLLM keeps it as the call's id only).
    "kimi_k2": ToolCallFormat(
        "<|tool_call_begin|>",
        "<|tool_call_end|>",
        lambda call, index: f"functions.{call.name}:{index}<|tool_call_argument_begin|>{_json(call.arguments)}",
        _kimi_read,
        section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        markers=("<|tool_call_argument_begin|>",),
    ),
}

# The format each family's checkpoints write (mint.models.families), by family name, or by a wrapper's model_type
# where the wrapper's checkpoint writes another format than its text model's family (Kimi-K2.5 over DeepSeek-V3).
FAMILY_FORMAT: dict[str, str] = {
    "qwen3_moe": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen2": "hermes",
    "qwen3_next": "qwen3_coder",
    "qwen3_5_moe": "qwen3_coder",
    "qwen3_5": "qwen3_coder",
    "glm4_moe": "glm45",
    "glm4_moe_lite": "glm47",
    "glm_moe_dsa": "glm47",
    "deepseek_v3": "deepseek_v31",
    "deepseek_v32": "deepseek_v32",
    "kimi_k25": "kimi_k2",
}


def _format(family_format: str) -> ToolCallFormat:
    if family_format not in FORMATS:
        raise ValueError(f"tool-call format {family_format!r} is not one of {', '.join(FORMATS)}")
    return FORMATS[family_format]


def render_tool_call(family_format: str, call: ToolCall) -> str:
    """The text a model of the format's family writes for a turn that makes this one call (inside its section's
    markers, where the format has them)."""
    return render_turn(family_format, [call])


def render_turn(family_format: str, calls: Sequence[ToolCall], content: str = "") -> str:
    """A whole assistant turn: `content`, then its calls, joined as the family's chat template joins them."""
    fmt = _format(family_format)
    text = fmt.sep.join(fmt.open + fmt.body(call, i) + fmt.close for i, call in enumerate(calls))
    if calls and fmt.section:
        text = fmt.section[0] + fmt.inner + text + fmt.inner + fmt.section[1]
    return content + fmt.lead + text if content and calls else content + text


def _blocks(text: str, open_: str, close: str, markers: Sequence[str]) -> tuple[list[str], list[str]]:
    """`text` split into its parts outside `open_ ... close` blocks and the blocks' bodies. A block left open or
    opened inside another, and a `close` or one of `markers` outside any block, are malformed."""
    outside, bodies, at = [], [], 0
    while (start := text.find(open_, at)) >= 0:
        end = text.find(close, start + len(open_))
        if end < 0:
            raise _Malformed(f"unclosed {open_}")
        if open_ in (body := text[start + len(open_) : end]):
            raise _Malformed(f"{open_} opened again before {close}")
        outside.append(text[at:start])
        bodies.append(body)
        at = end + len(close)
    outside.append(text[at:])
    if stray := next((m for m in (close, *markers) for part in outside if m in part), None):
        raise _Malformed(f"{stray} outside {open_}...{close}")
    return outside, bodies


def parse_tool_calls(family_format: str, text: str, tools: Sequence[Tool] | None = None) -> ParsedTurn:
    """The content and calls of a turn written in `family_format` (its text after any reasoning: splitting off a
    `<think>` block is the caller's). With `tools`, a call to a tool not among them is an error, and the XML-like
    formats type their values by the tool's schema (without, they stay strings)."""
    fmt = _format(family_format)
    by_name = None if tools is None else {tool.name: tool for tool in tools}
    try:
        if fmt.section:
            outside, sections = _blocks(text, *fmt.section, (fmt.open, fmt.close, *fmt.markers))
            bodies = []
            for section in sections:
                between, found = _blocks(section, fmt.open, fmt.close, fmt.markers)
                if "".join(between).strip():
                    raise _Malformed(f"text between calls: {''.join(between).strip()[:40]!r}")
                bodies += found
        else:
            outside, bodies = _blocks(text, fmt.open, fmt.close, fmt.markers)
        calls = [fmt.read(body, by_name) for body in bodies]
        if by_name is not None and (unknown := [call.name for call in calls if call.name not in by_name]):
            raise _Malformed(f"unknown tool {unknown[0]!r} (tools: {', '.join(by_name) or 'none'})")
    except _Malformed as err:
        return ParsedTurn(text.strip(), [], str(err))
    return ParsedTurn("".join(outside).strip(), calls)


# ---- checking a call against its tool's schema ----

_TYPES: dict[str, Callable[[object], bool]] = {
    "boolean": lambda v: isinstance(v, bool),
    # JSON has one number type: 2.0 is an integer to a schema; a bool is no number.
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _type_name(value: object) -> str:
    return next((kind for kind, fits in _TYPES.items() if fits(value)), type(value).__name__)


def _check(value: object, schema: object, path: str) -> str | None:
    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or ())
    known = [kind for kind in kinds if kind in _TYPES]  # a type this checker does not know goes unchecked
    if known and not any(_TYPES[kind](value) for kind in known):
        return f"{path}: expected {' or '.join(known)}, got {_type_name(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {_json(value)[:40]} is not one of {_json(schema['enum'])[:80]}"
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        if missing := [key for key in schema.get("required", ()) if key not in value]:
            return f"{path}: missing required argument {', '.join(missing)}"
        if (extra := [key for key in value if key not in props]) and schema.get("additionalProperties") is False:
            return f"{path}: unknown argument {', '.join(extra)} (takes {', '.join(props) or 'none'})"
        items = [(item, props.get(key), f"{path}.{key}") for key, item in value.items()]
    elif isinstance(value, list):
        items = [(item, schema.get("items"), f"{path}[{i}]") for i, item in enumerate(value)]
    else:
        items = []
    return next((error for item in items if (error := _check(*item))), None)


def check_arguments(tool: Tool, call: ToolCall) -> str | None:
    """One line on why `call` does not fit `tool`'s schema, or None: required keys present, no unknown key where
    additionalProperties is false, enum members, and the JSON types (string, number, integer, boolean, object,
    array, null), down through nested properties and array items."""
    if call.name != tool.name:
        return f"call to {call.name} checked against tool {tool.name}"
    return _check(call.arguments, {"type": "object", **tool.parameters}, call.name)
