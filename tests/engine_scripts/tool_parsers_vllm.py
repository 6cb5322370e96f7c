"""Runs in the engine virtualenv: reads {"tools": [...], "cases": [{"parser", "text"}]} on stdin and prints, per
case, the calls ([name, arguments]) and content vLLM's parser of that name finds; "registered" lists its parser
names (tests/test_tool_calls.py)."""

import json
import sys

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager

job = json.load(sys.stdin)
# The parsers look their markers up in the vocabulary (DeepSeek-V3.1's refuses to start without them).
markers = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    "<|tool_call_argument_begin|>",
]
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), unk_token="<unk>"
)
tokenizer.add_special_tokens({"additional_special_tokens": markers})
request = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=job["tools"])
results = []
for case in job["cases"]:
    parser = ToolParserManager.get_tool_parser(case["parser"])(tokenizer, job["tools"])
    found = parser.extract_tool_calls(case["text"], request)
    calls = [[c.function.name, json.loads(c.function.arguments)] for c in found.tool_calls]
    results.append({"calls": calls, "content": found.content or ""})
print(json.dumps({"registered": sorted(ToolParserManager.list_registered()), "results": results}))
