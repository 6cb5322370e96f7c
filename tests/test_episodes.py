"""Episodes: the runner's record (mint.envs.episode) over the built-in engine as a policy (mint.rollout.episodes).

The record must be what the learner replays: the tail after the prompt holds every action as sampled and every
observation as given, `loss_mask` is 1 exactly on sampled tokens of unmasked actions, and the logprobs are those of
the tokens at their positions (a teacher-forced forward of the whole episode gives them back).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import AutoTokenizer

from longstraw.routing import RouteRecorder
from longstraw.scoring import token_logprobs
from mint.envs.env import Env, EnvGroupBuilder, StepResult, StopCondition, StopReason
from mint.envs.episode import EpisodeLimits, Sample, run_episode, run_group
from mint.models.specs import load_model
from mint.models.tiny import ensure_tiny
from mint.rollout.engine import RolloutEngine
from mint.rollout.episodes import EnginePolicy


@pytest.fixture(scope="module")
def base():
    path = ensure_tiny("qwen3")
    return load_model(path), AutoTokenizer.from_pretrained(path)


class Echo(Env):
    """Answers every action with a fixed observation; done after `turns` actions. Records what it was given."""

    def __init__(self, prompt, observation, turns, stop, mask_turn=None, sleep_s=0.0):
        self.prompt, self.observation, self.turns, self.stop = prompt, observation, turns, stop
        self.mask_turn, self.sleep_s = mask_turn, sleep_s
        self.actions: list[list[int]] = []
        self.closed = 0

    async def initial_observation(self):
        return list(self.prompt), self.stop

    async def step(self, action):
        self.actions.append(list(action))
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)
        done = len(self.actions) == self.turns
        return StepResult(
            reward=float(len(self.actions)),
            episode_done=done,
            next_observation=[] if done else list(self.observation),
            mask_action=len(self.actions) == self.mask_turn,
            metrics={"turn": len(self.actions)},
        )

    async def close(self):
        self.closed += 1


class Builder(EnvGroupBuilder):
    def __init__(self, envs):
        self.envs = envs

    async def make_envs(self):
        return self.envs

    async def group_rewards(self, episodes):
        return [10.0 * i for i in range(len(episodes))]


def _prompt(tokenizer, text="Q: 3 + 4 =") -> list[int]:
    return tokenizer(text)["input_ids"]


def test_a_group_of_episodes_records_what_the_learner_replays(base):
    model, tokenizer = base
    engine = RolloutEngine(model, eos_token_ids=[])
    policy = EnginePolicy(engine, revision="rev-a", seed=3)
    observation = tokenizer("\nresult: 7\n")["input_ids"]
    stop = StopCondition(stop_tokens=(), max_tokens=5)
    envs = [Echo(_prompt(tokenizer), observation, 3, stop, mask_turn=2 if i == 1 else None) for i in range(4)]
    limits = EpisodeLimits(max_turns=8, max_tokens=200, context=400)
    episodes = asyncio.run(run_group(Builder(envs), policy, limits, key="g0"))

    assert policy.batches == 3  # the four episodes' turns went out together, one decode batch per turn
    for i, (env, ep) in enumerate(zip(envs, episodes, strict=True)):
        assert env.closed == 1 and ep.stop_reason is StopReason.COMPLETED
        assert [t.action for t in ep.turns] == [5, 5, 5]
        assert [t.observation for t in ep.turns] == [len(observation), len(observation), 0]
        # the tail: the actions exactly as the environment received them, each followed by the observation
        expected = env.actions[0] + observation + env.actions[1] + observation + env.actions[2]
        assert ep.tokens == expected and len(ep.loss_mask) == len(ep.logprobs) == len(expected)
        sampled = [1] * 5 + [0] * len(observation) + [1] * 5 + [0] * len(observation) + [1] * 5
        mask = list(sampled)
        if i == 1:  # its second action was masked: sampled, recorded, no loss
            mask[5 + len(observation) : 10 + len(observation)] = [0] * 5
        assert ep.loss_mask == mask
        assert [math.isnan(lp) for lp in ep.logprobs] == [s == 0 for s in sampled]
        assert ep.reward == 1.0 + 2.0 + 3.0 + 10.0 * i and [t.revision for t in ep.turns] == ["rev-a"] * 3
        assert ep.turns[1].masked == (i == 1) and ep.turns[2].metrics == {"turn": 3}
        # the recorded logprobs are the policy's for these tokens at these positions
        ids = torch.tensor(ep.prompt + ep.tokens)
        with torch.no_grad():
            logits = model(ids[None, :-1]).logits[0]
        P = len(ep.prompt)
        teacher = token_logprobs(logits[P - 1 :], ids[P:], 1.0)
        at = [j for j, s in enumerate(sampled) if s]
        torch.testing.assert_close(torch.tensor([ep.logprobs[j] for j in at]), teacher[at], atol=1e-4, rtol=0)
    assert len({tuple(ep.tokens) for ep in episodes}) > 1  # each episode drew its own actions


def test_the_runner_stops_at_each_limit_and_says_why(base):
    model, tokenizer = base
    prompt, observation = _prompt(tokenizer), tokenizer(" ok")["input_ids"]
    stop = StopCondition(stop_tokens=(), max_tokens=4)

    def run(env, limits):
        policy = EnginePolicy(RolloutEngine(model, eos_token_ids=[]), revision="r", seed=0)
        return asyncio.run(run_episode(env, policy, "k", limits)), env

    ep, env = run(Echo(prompt, observation, 100, stop), EpisodeLimits(max_turns=3, max_tokens=500, context=900))
    assert ep.stop_reason is StopReason.MAX_TURNS and len(ep.turns) == 3 and env.closed == 1
    assert len(ep.tokens) == 3 * 4 + 2 * len(observation)  # no observation after the last action: nothing follows it

    # the token budget: the last action is cut to what is left of it, and no observation follows one that fills it
    limit = 4 + len(observation) + 3
    ep, _ = run(Echo(prompt, observation, 100, stop), EpisodeLimits(max_turns=9, max_tokens=limit, context=900))
    assert len(ep.tokens) <= limit and ep.stop_reason is StopReason.MAX_TOKENS
    assert [t.action for t in ep.turns] == [4, 3]

    # the context: an observation that would leave no room for a token ends the episode before it is appended
    context = len(prompt) + 4 + len(observation)
    ep, _ = run(Echo(prompt, observation, 100, stop), EpisodeLimits(max_turns=9, max_tokens=500, context=context))
    assert ep.stop_reason is StopReason.CONTEXT_OVERFLOW and len(ep.tokens) == 4
    ep, _ = run(Echo(prompt, observation, 100, stop), EpisodeLimits(max_turns=9, context=len(prompt)))
    assert ep.stop_reason is StopReason.CONTEXT_OVERFLOW and ep.tokens == []

    # a step that does not answer in time: the episode ends with its action recorded, and the env is still closed
    ep, env = run(Echo(prompt, observation, 100, stop, sleep_s=5.0), EpisodeLimits(step_timeout_s=0.2))
    assert ep.stop_reason is StopReason.TIMEOUT and len(ep.tokens) == 4 and ep.loss_mask == [1] * 4
    assert env.closed == 1


def test_an_engine_error_reaches_every_waiting_episode_and_every_env_is_closed(base):
    model, tokenizer = base
    bad = StopCondition(stop_tokens=("x",), max_tokens=3)  # not an id: the engine's SamplingParams refuses it
    envs = [Echo(_prompt(tokenizer), [], 2, bad) for _ in range(2)]
    policy = EnginePolicy(RolloutEngine(model, eos_token_ids=[]), revision="r")
    with pytest.raises(Exception, match="stop_token_ids"):
        asyncio.run(run_group(Builder(envs), policy, EpisodeLimits(), key="g"))
    assert [env.closed for env in envs] == [1, 1]


def test_an_moe_episode_records_the_route_of_every_position():
    """R3 over the whole episode: the policy's rows for the prompt, the actions and the observations, joined, equal
    the routes of one full forward over the episode (the engine's prefill and decode route as a full forward does)."""
    path = ensure_tiny("qwen3_moe")
    model, tokenizer = load_model(path), AutoTokenizer.from_pretrained(path)
    policy = EnginePolicy(RolloutEngine(model, eos_token_ids=[]), revision="r", seed=1)
    stop = StopCondition(stop_tokens=(), max_tokens=4)
    envs = [Echo(_prompt(tokenizer), tokenizer(" -> 12;")["input_ids"], 3, stop) for _ in range(3)]
    episodes = asyncio.run(run_group(Builder(envs), policy, EpisodeLimits(), key="moe"))
    for ep in episodes:
        ids = torch.tensor(ep.prompt + ep.tokens)
        assert ep.routes.shape[0] == len(ids) - 1 and ep.routes.dtype == torch.uint8
        with torch.inference_mode(), RouteRecorder(model) as recorder:
            model(input_ids=ids[None, :-1], use_cache=False)
            full = recorder.pop()
        assert torch.equal(ep.routes.long(), full)
    assert policy._routes == {} and policy._positions == {}  # released with the episodes


class TeacherForced:
    """A policy that emits given actions (token ids chosen by the test), one per turn: it pins what was "sampled"
    so a test can pick ids whose text does not encode back to them."""

    def __init__(self, actions):
        self.actions = list(actions)

    async def sample(self, key, context, stop):
        tokens = self.actions.pop(0)
        return Sample(tokens=tokens, logprobs=[-1.0] * len(tokens), revision="forced", finish_reason="stop")

    async def release(self, key):
        return None


def test_sampled_ids_that_do_not_survive_decode_and_encode_stay_as_sampled():
    """The ids of "a" then "r", sampled as two tokens, decode to "ar", which the tokenizer encodes as one. The retry
    environment reads the text (it must: it checks the answer), but the record keeps the two sampled ids, and the
    feedback after them is the template's delta, not a re-encoding of the conversation."""
    from mint.envs.retry import FEEDBACK, retry
    from mint.rl.tasks import Example

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("qwen3"))
    a, r = tokenizer.convert_tokens_to_ids(["a", "r"])
    eos = tokenizer.eos_token_id
    assert tokenizer.encode(tokenizer.decode([a, r]), add_special_tokens=False) != [a, r]  # the premise
    example = Example("What is the first digit of 7 1 2?", "7")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}], add_generation_prompt=True)
    builder = retry(example, tokenizer, _config(group_size=2), list(prompt), StopCondition((eos,), 4))
    first, second = [a, r, eos], [tokenizer.convert_tokens_to_ids("7"), eos]
    policy = TeacherForced([first, first, second, second])
    episodes = asyncio.run(run_group(builder, policy, EpisodeLimits(max_turns=3), key="rt"))
    for ep in episodes:
        feedback = ep.tokens[len(first) : len(ep.tokens) - len(second)]
        assert ep.tokens[: len(first)] == first and ep.tokens[-len(second) :] == second
        assert tokenizer.decode(feedback) == f"\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
        assert ep.loss_mask == [1] * len(first) + [0] * len(feedback) + [1] * len(second)
        assert ep.reward == 0.5 and ep.stop_reason is StopReason.COMPLETED  # right at the second try


def _config(group_size: int):
    from mint.config import build_config

    return build_config({}, [f"rollout.group_size={group_size}"])
