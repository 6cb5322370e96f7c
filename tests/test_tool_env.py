"""A chat environment with a tool (mint.envs.tool_env), here the Python interpreter of mint.envs.python_tool, driven
by the episode runner with actions chosen by the test (a teacher-forced policy: the tiny bases were never taught to
call it). The tool's results come back as template deltas, its failures as results the model reads, and every
episode's sandbox is gone when the episode is."""

from __future__ import annotations

import asyncio

import psutil
import pytest
from test_episodes import TeacherForced
from transformers import AutoTokenizer

from mint.envs import EpisodeLimits, StopCondition, StopReason, run_episode
from mint.envs.python_tool import python_env
from mint.envs.sandbox import SandboxLimits
from mint.envs.tool_calls import ToolCall, render_turn
from mint.models.tiny import ensure_tiny
from mint.rl.tasks import Example


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny("qwen3"))


def _call(tokenizer, code: str) -> list[int]:
    text = render_turn("hermes", [ToolCall("python", {"code": code})])
    return _answer(tokenizer, text)


def _answer(tokenizer, text: str) -> list[int]:
    """The ids of `text` and the end of the turn, as a model that wrote it would have sampled them."""
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def _run(tokenizer, actions, tmp_path, limits=None):
    stop = StopCondition((tokenizer.eos_token_id,), 512)
    env = python_env(Example("What is 6 times 7?", "42"), tokenizer, stop, limits=limits, temp_root=tmp_path)
    episode = asyncio.run(run_episode(env, TeacherForced(actions), "py", EpisodeLimits(max_tokens=4096)))
    return env, episode


def _observations(tokenizer, episode) -> list[str]:
    return [
        tokenizer.decode(episode.tokens[t.start + t.action : t.start + t.action + t.observation]) for t in episode.turns
    ]


def _no_sandbox_left(tmp_path) -> None:
    assert list(tmp_path.iterdir()) == []  # every episode folder removed
    mine = psutil.Process().children(recursive=True)
    assert not [p for p in mine if "_sandbox_worker" in " ".join(p.cmdline())]


def test_calls_share_one_interpreter_and_their_output_is_the_next_observation(tokenizer, tmp_path):
    actions = [_call(tokenizer, "x = 6 * 7"), _call(tokenizer, "print(x)"), _answer(tokenizer, "42")]
    _, episode = _run(tokenizer, actions, tmp_path)
    assert episode.stop_reason is StopReason.COMPLETED and episode.reward == 1.0
    first, second, last = _observations(tokenizer, episode)
    assert first == "\n<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert "<tool_response>\n42\n</tool_response>" in second and last == ""
    assert [t.metrics["tool_calls"] for t in episode.turns] == [1.0, 1.0, 0.0]
    assert episode.tokens[: len(actions[0])] == actions[0]  # the call as sampled, not re-encoded
    _no_sandbox_left(tmp_path)


@pytest.mark.parametrize(
    "code, says",
    [
        ("import os; os._exit(3)", "process exited with status 3"),
        ("while True: pass", "timeout"),
        ("1 / 0", "ZeroDivisionError"),
    ],
)
def test_a_failing_call_is_a_result_the_model_reads_and_the_episode_goes_on(tokenizer, tmp_path, code, says):
    limits = SandboxLimits(cpu_s=2, wall_s=1.0)
    actions = [_call(tokenizer, code), _call(tokenizer, "print(6 * 7)"), _answer(tokenizer, "42")]
    _, episode = _run(tokenizer, actions, tmp_path, limits)
    assert episode.stop_reason is StopReason.COMPLETED and episode.reward == 1.0
    failed, worked, _ = _observations(tokenizer, episode)
    assert "error: " in failed and says in failed, failed
    assert "<tool_response>\n42\n</tool_response>" in worked
    assert [t.metrics["tool_errors"] for t in episode.turns] == [1.0, 0.0, 0.0]
    _no_sandbox_left(tmp_path)


def test_a_call_that_cannot_be_read_ends_the_episode_masked(tokenizer, tmp_path):
    broken = _answer(tokenizer, '<tool_call>\n{"name": "python", "arguments": {"code": 1}}\n</tool_call>')
    _, episode = _run(tokenizer, [broken], tmp_path)
    assert episode.stop_reason is StopReason.PARSE_ERROR and episode.reward == 0.0
    assert episode.loss_mask == [0] * len(broken) and episode.turns[0].masked
    _no_sandbox_left(tmp_path)
