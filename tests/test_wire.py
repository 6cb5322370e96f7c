"""mint.wire: the step's dataclasses, pickled as Ray pickles them (protocol 5, read-only out-of-band buffers), carry
their tensors as numpy arrays and come back equal (real Ray transport: every training test)."""

import pickle

import torch

from mint.rollout.engine import Completion, GroupRollout
from mint.train.inner_step import GroupBatch


def _through_ray_style_pickle(obj):
    """Protocol 5 with out-of-band buffers handed back read-only, as Ray's object store hands them."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    readonly = [memoryview(bytes(b.raw())) for b in buffers]  # bytes: immutable, like a sealed plasma object
    return pickle.loads(data, buffers=readonly), len(buffers)


def test_a_group_rollout_round_trips_with_tensors_equal_and_writable():
    completions = [
        Completion(torch.arange(5) + i, torch.randn(5), torch.randint(0, 8, (5, 2, 4), dtype=torch.uint8), "stop")
        for i in range(3)
    ]
    completions.append(Completion(torch.tensor([7]), torch.tensor([-0.5]), None, "length"))  # routes missing
    group = GroupRollout(torch.arange(11), torch.randint(0, 8, (10, 2, 4), dtype=torch.int16), completions)
    back, n_buffers = _through_ray_style_pickle(group)
    assert n_buffers >= 10  # the tensors really went out of band as arrays, not through torch's own pickling
    assert torch.equal(back.prompt_tokens_P, group.prompt_tokens_P)
    assert back.prompt_routes_P1_L_K.dtype == torch.int16
    assert torch.equal(back.prompt_routes_P1_L_K, group.prompt_routes_P1_L_K)
    for got, want in zip(back.completions, completions, strict=True):
        assert isinstance(got.tokens_R, torch.Tensor) and torch.equal(got.tokens_R, want.tokens_R)
        assert got.logprobs_R.dtype == torch.float32 and torch.equal(got.logprobs_R, want.logprobs_R)
        assert (got.routes_R_L_K is None) == (want.routes_R_L_K is None)
        if want.routes_R_L_K is not None:
            assert torch.equal(got.routes_R_L_K, want.routes_R_L_K)
        assert got.finish_reason == want.finish_reason
    back.completions[0].tokens_R[0] = 99  # owns writable memory (the read-only buffer was copied)
    assert completions[0].tokens_R[0] == 0


def test_a_frozen_group_batch_round_trips_and_leaves_bfloat16_to_torch():
    batch = GroupBatch(
        prompt_tokens_P=torch.arange(6),
        responses=[torch.arange(3), torch.arange(2)],
        rollout_logprobs=[torch.randn(3), torch.randn(2)],
        adv_G=torch.randn(2).to(torch.bfloat16),  # numpy has no bfloat16: pickled by torch, still equal
        routes=[None, torch.zeros(2, 1, 2, dtype=torch.uint8)],
    )
    back, _ = _through_ray_style_pickle(batch)
    assert back.lengths == [3, 2]
    assert back.adv_G.dtype == torch.bfloat16 and torch.equal(back.adv_G, batch.adv_G)
    assert all(torch.equal(a, b) for a, b in zip(back.rollout_logprobs, batch.rollout_logprobs, strict=True))
    assert back.routes[0] is None and torch.equal(back.routes[1], batch.routes[1])
