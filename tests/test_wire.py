"""mint.train.wire: torch tensors cross Ray through the serializer the driver and every actor register, as their
bytes in one numpy buffer, and come back equal (dtype, shape, values) and writable. The step's dataclasses are plain:
they know nothing of transport. Real local Ray: the driver and an actor process, small tensors inline and large ones
through the object store (read-only buffers)."""

import sys

import pytest
import ray
import torch

from mint.config import build_config
from mint.rollout.engine import Completion, GroupRollout
from mint.train import wire
from mint.train.inner_step import GroupBatch


def _carried_by_wire() -> bool:
    """Whether this process hands Ray its tensors through mint.train.wire (the pickle names its deserializer)."""
    return b"from_wire" in ray.cloudpickle.dumps(torch.zeros(2))


@ray.remote(num_cpus=0)
class Echo:
    """A process that registers the serializer at start-up, as LearnerActor and RolloutActor do."""

    def __init__(self):
        wire.register()

    def echo(self, obj):
        return obj

    def carried_by_wire(self) -> bool:
        return _carried_by_wire()


# Every test with this fixture starts a local Ray (`ray.init`), so it is marked slow: `make test-fast` starts no Ray.
@pytest.fixture(scope="module")
def echo():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    wire.register()
    try:
        yield Echo.remote()
    finally:
        ray.shutdown()


def _group(length: int) -> GroupRollout:
    completions = [
        Completion(
            torch.arange(length) + i,
            torch.randn(length),
            torch.randint(0, 8, (length, 2, 4), dtype=torch.uint8),
            "stop",
        )
        for i in range(3)
    ]
    completions.append(Completion(torch.tensor([7]), torch.tensor([-0.5]), None, "length"))  # routes missing
    return GroupRollout(torch.arange(11), torch.randint(0, 8, (10, 2, 4), dtype=torch.int16), completions)


@pytest.mark.slow
def test_both_ends_send_tensors_through_the_wire(echo):
    assert _carried_by_wire()
    assert ray.get(echo.carried_by_wire.remote())


# 5 tokens: every buffer travels inline; 40,000 tokens: the routes (320 KB each) go through the object store, whose
# buffers Ray hands back read-only.
@pytest.mark.slow
@pytest.mark.parametrize("length", [5, 40_000])
def test_a_group_rollout_round_trips_through_ray_equal_and_writable(echo, length):
    group = _group(length)
    ref = echo.echo.remote(group)
    back = ray.get(ref)
    assert type(back) is GroupRollout and torch.equal(back.prompt_tokens_P, group.prompt_tokens_P)
    assert back.prompt_routes_P1_L_K.dtype == torch.int16
    assert torch.equal(back.prompt_routes_P1_L_K, group.prompt_routes_P1_L_K)
    want_routes = group.completions[0].routes_R_L_K
    for got, want in zip(back.completions, group.completions, strict=True):
        assert got.tokens_R.dtype == torch.int64 and torch.equal(got.tokens_R, want.tokens_R)
        assert got.logprobs_R.dtype == torch.float32 and torch.equal(got.logprobs_R, want.logprobs_R)
        assert (got.routes_R_L_K is None) == (want.routes_R_L_K is None)
        if want.routes_R_L_K is not None:
            assert got.routes_R_L_K.dtype == torch.uint8 and torch.equal(got.routes_R_L_K, want.routes_R_L_K)
        assert got.finish_reason == want.finish_reason
    # Each tensor owns its memory: writing to it leaves Ray's stored copy, which every reader shares, alone.
    back.completions[0].tokens_R[0] = 99
    back.completions[0].routes_R_L_K[0] = 7
    again = ray.get(ref)
    assert again.completions[0].tokens_R[0] == 0 and torch.equal(again.completions[0].routes_R_L_K, want_routes)


@pytest.mark.slow
def test_a_frozen_group_batch_round_trips_with_bfloat16_and_views(echo):
    whole = torch.arange(10)
    batch = GroupBatch(
        prompt_tokens_P=whole[2:8],  # a view: only its 6 elements cross
        responses=[torch.arange(3), torch.arange(2)],
        rollout_logprobs=[torch.randn(3), torch.randn(2)],
        adv_G=torch.randn(2).to(torch.bfloat16),  # numpy has no bfloat16: its bytes cross as uint8
        routes=[None, torch.zeros(2, 1, 2, dtype=torch.uint8)],
    )
    back = ray.get(echo.echo.remote(batch))
    assert back.lengths == [3, 2]
    assert torch.equal(back.prompt_tokens_P, whole[2:8]) and back.prompt_tokens_P.untyped_storage().nbytes() == 48
    assert back.adv_G.dtype == torch.bfloat16 and torch.equal(back.adv_G, batch.adv_G)
    assert all(torch.equal(a, b) for a, b in zip(back.rollout_logprobs, batch.rollout_logprobs, strict=True))
    assert back.routes[0] is None and torch.equal(back.routes[1], batch.routes[1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),  # 0-d
        torch.zeros(0, 3),  # no bytes
        torch.tensor([True, False]),
        torch.randn(3, 4).t(),  # non-contiguous: made contiguous first
        torch.randn(3, requires_grad=True),
        (torch.randn(2) + 1j * torch.randn(2)).conj(),  # a lazy conjugate: resolved before its bytes are read
    ],
    ids=["scalar", "empty", "bool", "transposed", "requires_grad", "conj"],
)
def test_odd_tensors_round_trip(echo, tensor):
    back = ray.get(echo.echo.remote(tensor))
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and back.requires_grad == tensor.requires_grad
    assert torch.equal(back.detach(), tensor.detach().resolve_conj())


def test_the_actors_register_the_serializer_at_start_up():
    """LearnerActor and RolloutActor register it in their constructors: a tensor a rollout actor returns (its
    groups) crosses as a numpy buffer even though nothing else in its process registered it."""
    from mint.train.learner import LearnerActor
    from mint.train.nodes import driver_model_path
    from mint.train.rollout_actor import RolloutActor

    config = build_config({"rollout": {"max_tokens": 4}})
    for make in (
        lambda: LearnerActor(config, "unused", 0, 1),
        lambda: RolloutActor(config, driver_model_path(config.model.path)),
    ):
        ray.util.deregister_serializer(torch.Tensor)
        assert not _carried_by_wire()
        make()
        assert _carried_by_wire()
