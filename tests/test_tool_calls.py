"""Tool calls in each family's own format (mint.envs.tool_calls), checked against vLLM's own parsers.

- Round trip: every format renders the cases' turns and reads them back (content and calls), typing the XML-like
  formats' bare-text values by the tools' schemas.
- Conformance: vLLM's parser for each format (the `--tool-call-parser` of the same name, which a server for that
  family runs) reads the text Mint renders, in one subprocess in the engine virtualenv (`engine_python`; importing
  vLLM takes ~10 s on 2 cores) with a tiny tokenizer built there that holds the formats' markers as special tokens;
  it must find the same names, arguments and content.
- Malformed turns give one line of error and no calls; check_arguments reports each kind of schema violation.
"""

from __future__ import annotations

import pytest
from conftest import run_engine_script

from mint.envs.tool_calls import (
    FAMILY_FORMAT,
    FORMATS,
    ParsedTurn,
    Tool,
    ToolCall,
    check_arguments,
    parse_tool_calls,
    render_tool_call,
    render_turn,
)
from mint.models.families import FAMILIES

TOOLS = [
    Tool(
        "get_weather",
        "The weather in a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    ),
    Tool(
        "search",
        "Search the notes.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "number"},
                "exact": {"type": "boolean"},
                "filters": {
                    "type": "object",
                    "properties": {"tags": {"type": "array", "items": {"type": "string"}}, "after": {"type": "string"}},
                },
                "fields": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
    ),
    Tool("noop", "Does nothing.", {"type": "object", "properties": {}}),
]
# (content, calls) per turn: quotes, backslashes, newlines (inside and at the ends of a value), unicode, a string
# that looks like a number, integers and floats, booleans, nested objects and arrays, no arguments, two calls.
CASES = [
    ("", [ToolCall("get_weather", {"city": "Paris", "days": 3})]),
    (
        "Let me look that up.",
        [ToolCall("get_weather", {"city": 'Saint "Malo"\\ \n on sea\n', "units": "metric"})],
    ),
    ("", [ToolCall("get_weather", {"city": "Zürich 東京 🌧", "days": -2})]),
    ("", [ToolCall("get_weather", {"city": "007"})]),
    (
        "Two at once:",
        [
            ToolCall("search", {"query": "\nleading newline", "limit": 2.5, "exact": True}),
            ToolCall("get_weather", {"city": "Oslo", "days": 10}),
        ],
    ),
    (
        "",
        [
            ToolCall(
                "search",
                {
                    "query": "a <b> & c",
                    "exact": False,
                    "filters": {"tags": ["x", 'y "z"'], "after": "2024-01-01"},
                    "fields": ["title", "body"],
                },
            )
        ],
    ),
    ("Nothing to call.", []),
    ("", [ToolCall("noop", {})]),
]


@pytest.mark.parametrize("family_format", FORMATS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_render_then_parse_round_trips(family_format, case):
    content, calls = CASES[case]
    text = render_turn(family_format, calls, content)
    assert parse_tool_calls(family_format, text, TOOLS) == ParsedTurn(content, calls), text


@pytest.mark.parametrize("family_format", FORMATS)
def test_one_call_renders_as_a_turn_of_one_call(family_format):
    call = CASES[0][1][0]
    assert render_tool_call(family_format, call) == render_turn(family_format, [call])
    assert parse_tool_calls(family_format, render_tool_call(family_format, call)).calls[0].name == call.name


@pytest.mark.parametrize("family_format", ["qwen3_coder", "glm45", "glm47"])
def test_bare_text_values_stay_strings_without_tools(family_format):
    """The XML-like formats write 3 and "3" alike; only the tool's schema tells them apart."""
    call = ToolCall("get_weather", {"city": "Oslo", "days": 3})
    parsed = parse_tool_calls(family_format, render_tool_call(family_format, call))
    assert parsed.calls == [ToolCall("get_weather", {"city": "Oslo", "days": "3"})]
    assert parse_tool_calls(family_format, render_tool_call(family_format, call), TOOLS).calls == [call]


def test_null_and_python_spellings_are_typed_by_the_schema():
    """Qwen's template prints Python values (True, None); a schema that allows them reads them as JSON's."""
    tool = Tool(
        "t", "", {"type": "object", "properties": {"a": {"type": ["string", "null"]}, "b": {"type": "boolean"}}}
    )
    call = ToolCall("t", {"a": None, "b": True})
    text = render_tool_call("qwen3_coder", call)
    assert "\nNone\n" in text and "\nTrue\n" in text
    for family_format in ("qwen3_coder", "glm47"):
        assert parse_tool_calls(family_format, render_tool_call(family_format, call), [tool]).calls == [call]


def test_family_format_names_every_family():
    """Each registered family (and the Kimi-K2.5 wrapper, which writes Kimi's format) has a format here."""
    wrappers = {wrapper.model_type for family in FAMILIES.values() for wrapper in family.wrappers}
    assert set(FAMILIES) <= set(FAMILY_FORMAT) <= set(FAMILIES) | wrappers
    assert set(FAMILY_FORMAT.values()) <= set(FORMATS)
    assert FAMILY_FORMAT["kimi_k25"] == "kimi_k2"


def test_tool_openai_is_the_function_tool_dict():
    assert TOOLS[2].openai() == {
        "type": "function",
        "function": {
            "name": "noop",
            "description": "Does nothing.",
            "parameters": {"type": "object", "properties": {}},
        },
    }


_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
MALFORMED = [
    ("hermes", f"<tool_call>\n{_WEATHER}\n", "unclosed <tool_call>"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>', "bad JSON"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "city=Paris"}\n</tool_call>', "not an object"),
    ("hermes", '<tool_call>\n{"name": "get_weather"}\n</tool_call>', "not an object"),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "unknown tool 'rm_rf'"),
    ("hermes", f"<tool_call>\n{_WEATHER}\n</tool_call>\n</tool_call>", "</tool_call> outside"),
    ("hermes", f"<tool_call>\n<tool_call>\n{_WEATHER}\n</tool_call>", "opened again"),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        "unexpected text",
    ),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n</tool_call>", "no <function=NAME>"),
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>", "outside"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n</function>\n", "unclosed"),
    ("glm47", "<tool_call>get_weather<arg_key>city</arg_key></tool_call>", "unexpected text"),
    (
        "glm47",
        "<tool_call>get_weather<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key>"
        "<arg_value>2</arg_value></tool_call>",
        "given twice",
    ),
    ("glm45", "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "function name"),
    (
        "deepseek_v31",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>',
        "unclosed <｜tool▁calls▁begin｜>",
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "no <｜tool▁sep｜>",
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        "array, not an object",
    ),
    ("deepseek_v31", "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>", "outside"),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        "functions.NAME:INDEX",
    ),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|>hello<|tool_call_begin|>functions.noop:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        "text between calls",
    ),
    (
        "deepseek_v32",
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n</｜DSML｜function_calls>',
        "unclosed",
    ),
]


@pytest.mark.parametrize(("family_format", "text", "says"), MALFORMED)
def test_malformed_turn_is_one_line_of_error_and_no_calls(family_format, text, says):
    parsed = parse_tool_calls(family_format, text, TOOLS)
    assert parsed.calls == [] and parsed.error is not None, parsed
    assert says in parsed.error and "\n" not in parsed.error, parsed.error
    assert parsed.content == text.strip()


def test_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="'llama' is not one of hermes"):
        parse_tool_calls("llama", "")


CHECKS = [
    (ToolCall("get_weather", {"city": "Paris", "days": 3, "units": "metric"}), None),
    (ToolCall("get_weather", {"city": "Paris", "days": 3.0}), None),
    (ToolCall("get_weather", {"days": 3}), "get_weather: missing required argument city"),
    (ToolCall("get_weather", {"city": "Paris", "when": "now"}), "get_weather: unknown argument when (takes city, day"),
    (ToolCall("get_weather", {"city": 7}), "get_weather.city: expected string, got integer"),
    (ToolCall("get_weather", {"city": "P", "days": True}), "get_weather.days: expected integer, got boolean"),
    (ToolCall("get_weather", {"city": "P", "days": 2.5}), "get_weather.days: expected integer, got number"),
    (ToolCall("get_weather", {"city": "P", "units": "kelvin"}), 'get_weather.units: "kelvin" is not one of'),
    (ToolCall("search", {"query": "q", "extra": 1}), None),  # additionalProperties is not false
    (ToolCall("search", {"query": "q", "limit": "10"}), "search.limit: expected number, got string"),
    (ToolCall("search", {"query": "q", "filters": {"tags": ["a", 2]}}), "search.filters.tags[1]: expected string"),
    (ToolCall("search", {"query": "q", "filters": []}), "search.filters: expected object, got array"),
    (ToolCall("search", {"query": None}), "search.query: expected string, got null"),
]


@pytest.mark.parametrize(("call", "says"), CHECKS)
def test_check_arguments(call, says):
    error = check_arguments(next(tool for tool in TOOLS if tool.name == call.name), call)
    assert error == says if says is None else error.startswith(says), error


def test_check_arguments_names_a_mismatched_tool():
    assert check_arguments(TOOLS[0], ToolCall("noop", {})) == "call to noop checked against tool get_weather"


# ---- vLLM's own parsers on the same text ----


@pytest.mark.slow
def test_vllm_parsers_read_what_we_render(engine_python, tmp_path):
    """Each format's text, as render_turn writes it, is read by vLLM's parser of the same name into the same calls
    and content as by parse_tool_calls. vLLM types the XML-like formats' values by the request's tools too."""
    jobs = [(fmt, content, calls) for fmt in FORMATS for content, calls in CASES if calls]
    texts = [render_turn(fmt, calls, content) for fmt, content, calls in jobs]
    cases = [{"parser": fmt, "text": text} for (fmt, _, _), text in zip(jobs, texts, strict=True)]
    job = {"tools": [tool.openai() for tool in TOOLS], "cases": cases}
    report = run_engine_script(engine_python, "tool_parsers_vllm.py", job, tmp_path)
    assert set(FORMATS) <= set(report["registered"])
    for (fmt, content, calls), text, vllm in zip(jobs, texts, report["results"], strict=True):
        ours = parse_tool_calls(fmt, text, TOOLS)
        assert ours == ParsedTurn(content, calls), text
        assert [[call.name, call.arguments] for call in ours.calls] == vllm["calls"], f"{fmt}:\n{text}"
        assert vllm["content"].strip() == content, f"{fmt}:\n{text}"
