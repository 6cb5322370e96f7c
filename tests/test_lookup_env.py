"""The `lookup` environment on hand-written actions (a teacher-forced policy), and the shipped tiny tool base."""

from __future__ import annotations

import asyncio
import os

import pytest
from test_episodes import TeacherForced
from transformers import AutoTokenizer

from mint.config import build_config
from mint.envs.env import StopCondition, StopReason
from mint.envs.episode import EpisodeLimits, run_group
from mint.envs.lookup import TABLE_SIZE, call_text, lookup, question, table_for
from mint.envs.registry import resolve_env
from mint.models import tiny_ship
from mint.models.tiny import ensure_tiny
from mint.rl.tasks import Example

EXAMPLE = Example("What is the first digit of 7 1 2?", "7")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny("qwen3_moe"))


def _run(tokenizer, *turns: str | tuple[str, str]):
    """A group of 2 episodes; each turn's action is one text for both, or a pair (the episodes decode together, so
    the policy is asked for turn 1 of both, then turn 2 of both). Returns the episodes and the first's action ids."""
    eos = tokenizer.eos_token_id
    builder = lookup(EXAMPLE, tokenizer, build_config({}, ["rollout.group_size=2"]), [], StopCondition((eos,), 80))
    pairs = [(t, t) if isinstance(t, str) else t for t in turns]
    ids = [[[*tokenizer.encode(a, add_special_tokens=False), eos] for a in pair] for pair in pairs]
    policy = TeacherForced([action for pair in ids for action in pair])
    episodes = asyncio.run(run_group(builder, policy, EpisodeLimits(max_turns=2), key="lk"))
    return episodes, [pair[0] for pair in ids]


def test_table_holds_the_answer_under_the_asked_key_and_is_the_same_for_every_episode():
    key, table = table_for(EXAMPLE)
    assert len(table) == TABLE_SIZE and table[key] == "7" and table_for(EXAMPLE) == (key, table)
    assert resolve_env("lookup") is lookup


def test_call_then_value_is_two_turns_and_reward_one(tokenizer):
    """The call is answered with the template's delta of a <tool_response> user turn; the observation carries no
    loss; the digit after it earns 1."""
    key, _ = table_for(EXAMPLE)
    (ep, _), (call, answer) = _run(tokenizer, call_text(key), "7")
    assert tokenizer.decode(ep.prompt) == f"<|im_start|>user\n{question(key)}<|im_end|>\n<|im_start|>assistant\n"
    observation = ep.tokens[len(call) : len(ep.tokens) - len(answer)]
    expected = "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(observation) == expected
    assert ep.loss_mask == [1] * len(call) + [0] * len(observation) + [1] * len(answer)
    assert ep.reward == 1.0 and ep.stop_reason is StopReason.COMPLETED and len(ep.turns) == 2
    assert ep.turns[0].metrics == {"tool_calls": 1.0, "tool_errors": 0.0}
    assert ep.turns[1].metrics == {"correct": 1.0, "tool_calls": 0.0, "tool_errors": 0.0}


def test_wrong_value_after_the_call_scores_zero(tokenizer):
    key, _ = table_for(EXAMPLE)
    (ep, _), _ = _run(tokenizer, call_text(key), "3")
    assert ep.reward == 0.0 and ep.turns[1].metrics["correct"] == 0.0


def test_direct_answer_ends_at_once_and_scores_only_if_right(tokenizer):
    (right, wrong), _ = _run(tokenizer, ("7", "4"))
    assert right.reward == 1.0 and wrong.reward == 0.0
    assert len(right.turns) == len(wrong.turns) == 1 and right.stop_reason is StopReason.COMPLETED


def test_unknown_key_is_answered_and_the_episode_goes_on(tokenizer):
    _, table = table_for(EXAMPLE)
    missing = next(k for k in "abcdefghijklmnopqrstuvwxyz" if k not in table)
    (ep, _), (call, answer) = _run(tokenizer, call_text(missing), "7")
    assert "unknown key" in tokenizer.decode(ep.tokens[len(call) : len(ep.tokens) - len(answer)])
    assert ep.turns[0].metrics["tool_errors"] == 1.0 and ep.reward == 1.0


@pytest.mark.parametrize(
    "action",
    [
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "q"}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "search", "arguments": {"key": "q"}}\n</tool_call>',  # unknown tool
        '<tool_call>\n{"name": "lookup", "arguments": {"k": "q"}}\n</tool_call>',  # wrong argument
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "q"}}',  # unclosed
    ],
)
def test_unreadable_call_ends_the_episode_masked_at_reward_zero(tokenizer, action):
    (ep, _), (ids,) = _run(tokenizer, action)
    assert ep.stop_reason is StopReason.PARSE_ERROR and ep.reward == 0.0 and ep.turns[0].masked
    assert ep.loss_mask == [0] * len(ids) and ep.turns[0].metrics["tool_errors"] == 1.0


def test_a_second_call_runs_into_the_turn_limit_at_reward_zero(tokenizer):
    key, _ = table_for(EXAMPLE)
    (ep, _), _ = _run(tokenizer, call_text(key), call_text(key))
    assert ep.stop_reason is StopReason.MAX_TURNS and ep.reward == 0.0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3"])
def test_shipped_tool_base_matches_its_manifest(family):
    """The recipe's bases (qwen3_moe for the built-in engine, dense qwen3 for vLLM): every file has its manifest's
    sha256, and each continues the shipped tiny base of its family."""
    from mint.models.tiny_tools import shipped_dir

    shipped = shipped_dir(family)
    manifest = tiny_ship.read_manifest(shipped)
    assert set(os.listdir(shipped)) == {*manifest["sha256"], tiny_ship.MANIFEST}
    assert tiny_ship.matches(shipped, manifest["sha256"]) and manifest["base"] == f"tiny:{family}"
    base = tiny_ship.read_manifest(ensure_tiny(family))["sha256"]
    assert manifest["base_sha256"] == base["model.safetensors"]
    assert manifest["sha256"]["tokenizer.json"] == base["tokenizer.json"]


@pytest.mark.parametrize("answer", ["7", "3"])
def test_tool_base_was_trained_on_the_ids_the_environment_gives(tokenizer, answer):
    """mint.models.tiny_tools spells the environment's text out (mint.models sits below mint.envs): its training
    episodes must be the ids, and the loss mask, of the environment's episode for the same actions."""
    from mint.models import tiny_tools

    key, _ = table_for(EXAMPLE)
    assert tiny_tools.call_text(key) == call_text(key) and tiny_tools.question(key) == question(key)
    (ep, _), _ = _run(tokenizer, call_text(key), answer)
    ids, mask = tiny_tools.episode(tokenizer, key, "7", None)
    assert ids[: len(ep.prompt)] == ep.prompt and mask[: len(ep.prompt)] == [0] * len(ep.prompt)
    tail, tail_mask = ids[len(ep.prompt) :], mask[len(ep.prompt) :]
    assert tail[:-2] == ep.tokens[:-2] and tail_mask == ep.loss_mask
    (guess, _), _ = _run(tokenizer, answer)
    ids, mask = tiny_tools.episode(tokenizer, key, "7", answer)
    assert ids == guess.prompt + guess.tokens and mask == [0] * len(guess.prompt) + guess.loss_mask
