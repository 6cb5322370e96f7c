"""tinker-cookbook's environments, unchanged, through Mint's episode runner (mint.envs.cookbook) on the tiny base.

Their environments hand back the whole next context; Mint's record keeps actions as sampled and observations as
deltas. These tests run their own example environments (the arithmetic problem of their math recipe, their
guess-the-number game) and their message-level adapter, with their Qwen3 renderer over the tiny base's tokenizer (the
same ChatML), and check the record against what their environments returned.
"""

from __future__ import annotations

import asyncio
import pickle
import re
from functools import partial

import pytest

# Not installed by `make setup` yet: tinker-cookbook 0.6.1 needs a tml-renderers the registry does not serve
# (docs/decisions.md, "Environments from tinker-cookbook").
pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (it is not yet an extra)")

import huggingface_hub.constants
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
from tinker_cookbook.recipes.multiplayer_rl.guess_number.env import GuessNumberEnvGroupBuilder
from tinker_cookbook.rl import types as cookbook
from tinker_cookbook.rl.message_env import EnvFromMessageEnv, MessageEnv, MessageStepResult
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
from transformers import AutoTokenizer

from mint.envs.cookbook import ContextRewritten, CookbookEnv, CookbookEnvError, CookbookGroupBuilder
from mint.envs.env import StopReason
from mint.envs.episode import EpisodeLimits, run_group
from mint.models.specs import load_model
from mint.models.tiny import ensure_tiny
from mint.rollout.engine import RolloutEngine
from mint.rollout.episodes import EnginePolicy

G = 4


@pytest.fixture(scope="module")
def base():
    """The tiny base and its tokenizer, with the Hub unreachable: nothing here may download."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        path = ensure_tiny("qwen3")
        tokenizer = AutoTokenizer.from_pretrained(path)
        yield load_model(path), tokenizer, renderers.get_renderer("qwen3", tokenizer)


def _policy(model, seed=0):
    return EnginePolicy(RolloutEngine(model, eos_token_ids=[]), revision="rev", seed=seed)


def _check_record(episode):
    """tokens are the turns' actions and observations in order; loss only on the actions."""
    tail, mask = [], []
    for turn in episode.turns:
        tail += episode.tokens[turn.start : turn.start + turn.action + turn.observation]
        mask += [1] * turn.action + [0] * turn.observation
    assert tail == episode.tokens and mask == episode.loss_mask


def test_their_arithmetic_env_runs_a_group_with_their_rewards_and_metrics(base):
    """ArithmeticEnv ("What is 2 + 5?", the tiny base's own task) in their ProblemGroupBuilder, G sampled episodes:
    the prompt is their rendering, each reward and metric is what their env gives for that action. Greedy, the tiny
    base answers 7, and their env pays it their full reward."""
    model, tokenizer, renderer = base
    theirs = ProblemGroupBuilder(env_thunk=partial(ArithmeticEnv, 2, 5, renderer=renderer), num_envs=G)
    # It reaches a rollout actor pickled, as their builders reach their remote workers.
    builder = pickle.loads(pickle.dumps(CookbookGroupBuilder(theirs, max_tokens=4, tokenizer=tokenizer)))
    episodes = asyncio.run(run_group(builder, _policy(model), EpisodeLimits(max_turns=2), key="arith"))

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 5?"}], add_generation_prompt=True)
    assert len(episodes) == G and builder.tags() == ["problems"] and builder.group_metrics == [{}] * G
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert [env._stop.stop_tokens for env in builder.envs] == [(im_end,)] * G  # their stop string, as Mint's id
    for ep in episodes:
        assert ep.prompt == list(prompt["input_ids"]) and ep.stop_reason is StopReason.COMPLETED
        (turn,) = ep.turns
        _check_record(ep)
        assert turn.observation == 0 and ep.loss_mask == [1] * turn.action
        # Their grading of the same action, by a fresh env of theirs: the reward and metrics Mint recorded.
        again = ArithmeticEnv(2, 5, renderer=renderer)
        result = asyncio.run(again.step(ep.tokens, extra={"stop_reason": turn.finish_reason}))
        assert turn.reward == ep.reward == result.reward
        assert turn.metrics == {"format": result.metrics["format"], "correct": result.metrics["correct"]}

    greedy = EnginePolicy(RolloutEngine(model, eos_token_ids=[]), revision="rev", temperature=0.0)
    episodes = asyncio.run(run_group(builder, greedy, EpisodeLimits(max_turns=2), key="greedy"))
    assert [tokenizer.decode(ep.tokens) for ep in episodes] == ["7<|im_end|>"] * G
    assert [ep.reward for ep in episodes] == [1.0] * G
    assert [ep.turns[0].metrics for ep in episodes] == [{"format": 1.0, "correct": 1.0}] * G


class DigitQuiz(MessageEnv):
    """Two questions in one conversation, the tiny base's other task: the first digit, then the last, of 3 1 4 1 5."""

    QUESTIONS = (("What is the first digit of 3 1 4 1 5?", "3"), ("What is the last digit of 3 1 4 1 5?", "5"))

    def __init__(self):
        self.messages = [{"role": "user", "content": self.QUESTIONS[0][0]}]

    async def initial_observation(self):
        return list(self.messages)

    async def step(self, message):
        asked = len(self.messages) // 2
        correct = float(renderers.get_text_content(message).strip() == self.QUESTIONS[asked][1])
        self.messages.append(message)
        done = asked + 1 == len(self.QUESTIONS)
        if not done:
            self.messages.append({"role": "user", "content": self.QUESTIONS[asked + 1][0]})
        return MessageStepResult(
            reward=correct, episode_done=done, next_messages=list(self.messages), metrics={"correct": correct}
        )


class Builder(cookbook.EnvGroupBuilder):
    """Their builder shape around their message-level adapter, with a group reward that ranks the group."""

    def __init__(self, renderer):
        self.renderer = renderer
        self.seen: list[cookbook.Trajectory] = []
        self.cleaned = 0

    async def make_envs(self):
        return [EnvFromMessageEnv(self.renderer, DigitQuiz()) for _ in range(G)]

    async def compute_group_rewards(self, trajectory_group, env_group):
        self.seen = trajectory_group
        return [(0.5 * i, {"rank": float(i)}) for i in range(len(trajectory_group))]

    async def cleanup(self):
        self.cleaned += 1

    def logging_tags(self):
        return ["digits"]


def test_their_full_context_becomes_mints_delta_over_two_turns(base):
    """Their EnvFromMessageEnv returns the whole re-rendered conversation each turn; with the tiny ChatML it extends
    the last context, so Mint's observation is exactly the new user turn and the next generation prompt. Their
    compute_group_rewards sees Trajectories whose observations are the full contexts, actions as sampled."""
    model, tokenizer, renderer = base
    theirs = Builder(renderer)
    builder = CookbookGroupBuilder(theirs, max_tokens=4, tokenizer=tokenizer)
    episodes = asyncio.run(run_group(builder, _policy(model, seed=1), EpisodeLimits(), key="quiz"))

    delta = tokenizer("\n<|im_start|>user\nWhat is the last digit of 3 1 4 1 5?<|im_end|>\n<|im_start|>assistant\n")
    assert theirs.cleaned == 1 and builder.tags() == ["digits"]
    assert builder.group_metrics == [{"rank": float(i)} for i in range(G)]
    assert any(len(ep.turns) == 2 for ep in episodes)  # the tiny base ends its answer with <|im_end|>
    for i, (ep, env, traj) in enumerate(zip(episodes, builder.envs, theirs.seen, strict=True)):
        _check_record(ep)
        assert ep.reward == sum(t.reward for t in ep.turns) + 0.5 * i
        for k, (turn, transition) in enumerate(zip(ep.turns, traj.transitions, strict=True)):
            assert transition.ob.to_ints() == ep.prompt + ep.tokens[: turn.start]  # their context = Mint's so far
            assert transition.ac.tokens == ep.tokens[turn.start : turn.start + turn.action]
            assert transition.ac.logprobs == ep.logprobs[turn.start : turn.start + turn.action]
            assert transition.reward == turn.reward and transition.metrics == turn.metrics
            if len(ep.turns) == 2 and k == 0:
                assert ep.tokens[turn.start + turn.action :][: turn.observation] == delta["input_ids"]
        if len(ep.turns) == 2:
            assert ep.stop_reason is StopReason.COMPLETED and traj.stop_reason == "completed"
            assert "correct" in ep.turns[1].metrics
        else:  # cut at its budget: their adapter ends the episode on a "length" stop
            assert ep.turns[0].finish_reason == "length" and ep.stop_reason is StopReason.MAX_TOKENS
        assert env.context == ep.prompt + ep.tokens


def test_their_guess_number_env_rewrites_the_past_and_is_refused(base):
    """GuessNumberEnv re-renders the conversation each turn with the model's turns under the role "player", not the
    "assistant" the policy sampled after: the next context is not the one the policy saw, and Mint refuses it in one
    line naming the env rather than train on tokens the policy never saw."""
    model, tokenizer, renderer = base
    builder = CookbookGroupBuilder(GuessNumberEnvGroupBuilder(answer=7, renderer=renderer, num_envs=2), 4, tokenizer)
    with pytest.raises(ContextRewritten, match=r"^GuessNumberEnv: the context after turn 1 differs") as err:
        asyncio.run(run_group(builder, _policy(model), EpisodeLimits(), key="guess"))
    assert "\n" not in str(err.value)
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)  # it crosses a Ray boundary whole


class _Fixed(cookbook.Env):
    """An env of their interface whose first observation and stop condition are given."""

    def __init__(self, observation, stop):
        self.observation, self.stop = observation, stop

    async def initial_observation(self):
        return self.observation, self.stop

    async def step(self, action, *, extra=None):
        raise AssertionError("not reached")


def test_an_image_chunk_or_a_multi_token_stop_string_is_refused_in_one_line(base):
    _, tokenizer, renderer = base
    image = tinker.ModelInput(chunks=[tinker.types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)])
    with pytest.raises(CookbookEnvError, match=r"^_Fixed: its observation holds a 'image' chunk"):
        asyncio.run(CookbookEnv(_Fixed(image, [2]), 4).initial_observation())
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "What is 3 + 4?"}])
    stop = renderers.get_renderer("role_colon", tokenizer).get_stop_sequences()[0]  # their "\n\nUser:"
    with pytest.raises(CookbookEnvError, match=re.escape(f"stop string {stop!r} is")):
        asyncio.run(CookbookEnv(_Fixed(prompt, [stop]), 4, tokenizer).initial_observation())
    with pytest.raises(CookbookEnvError, match="give the adapter the tokenizer"):
        asyncio.run(CookbookEnv(_Fixed(prompt, ["<|im_end|>"]), 4).initial_observation())
