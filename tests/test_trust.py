"""R3 route replay and IcePop: one audited per-token trust mask."""

import math
import pickle

import pytest
import torch
from conftest import load_fp32

from longstraw.routing import ExpertLayout, RouteRecorder, RouteReplay, find_routers, route_status
from longstraw.trust import CAUSES, REASONS, TrustCounts, icepop_status, trust_mask

LAYOUT = ExpertLayout(num_layers=2, num_experts=4, top_k=2)


def _reason(status: torch.Tensor) -> list[str]:
    return ["ok" if int(s) == 0 else REASONS[int(s) - 1] for s in status]


def test_route_status_reasons_and_precedence():
    ok = torch.tensor([[[0, 1], [2, 3]], [[3, 2], [1, 0]], [[0, 4], [1, 1]], [[1, 1], [2, 3]]], dtype=torch.uint8)
    assert _reason(route_status(ok, 4, LAYOUT)) == ["ok", "ok", "route_out_of_range", "route_duplicate"]
    assert _reason(route_status(None, 3, LAYOUT)) == ["route_missing"] * 3
    assert _reason(route_status(ok, 5, LAYOUT)) == ["route_missing"] * 5  # record shorter than the response
    assert _reason(route_status(ok[:, :1], 4, LAYOUT)) == ["route_layers"] * 4
    assert _reason(route_status(ok[:, :, :1], 4, LAYOUT)) == ["route_layout"] * 4  # top-1 record for a top-2 model
    assert _reason(route_status(ok.float(), 4, LAYOUT)) == ["route_layout"] * 4  # not integer ids
    assert _reason(route_status(ok, 4, LAYOUT, recorded_experts=8)) == ["route_layout"] * 4
    assert _reason(route_status(ok.to(torch.int16) - 1, 4, LAYOUT))[0] == "route_out_of_range"  # negative id


def test_icepop_band_edges_are_inclusive():
    rollout = torch.zeros(5)
    old = torch.tensor([math.log(0.5), math.log(5.0), math.log(0.5) - 1e-3, math.log(5.0) + 1e-3, 0.0])
    assert icepop_status(old, rollout, 0.5, 5.0).tolist() == [0, 0, 1, 2, 0]
    # A token the rollout found impossible (logprob -inf) is clamped, not nan, and counted high here; trust_mask then
    # drops it as non_finite before the band is looked at.
    assert icepop_status(torch.tensor([-1.0]), torch.tensor([-math.inf]), 0.5, 5.0).tolist() == [2]


def test_trust_counters_add_up():
    route = torch.tensor([0, 0, 4, 0, 1, 0])  # token 2 out of range, token 4 missing
    old = torch.tensor([0.0, -2.0, 0.0, 2.0, 0.0, -0.1])
    rollout = torch.zeros(6)
    mask, counts = trust_mask(route, icepop_status(old, rollout, 0.5, 5.0), old, rollout)
    assert mask.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert counts.masked["ratio_low"] == 1 and counts.masked["ratio_high"] == 1
    assert counts.masked["route_out_of_range"] == 1 and counts.masked["route_missing"] == 1
    assert counts.kept + sum(counts.masked.values()) == counts.tokens == 6
    d = -0.1  # mismatch KL over kept tokens only: k3 of token 5 (token 0 has d = 0)
    assert counts.mismatch_kl_sum == pytest.approx(math.exp(d) - d - 1, rel=1e-5)
    total = TrustCounts()
    total.add(counts)
    total.add(pickle.loads(pickle.dumps(counts)))  # crosses Ray from each learner rank
    assert total.tokens == 12 and total.kept + sum(total.masked.values()) == 12
    assert total.metrics()["trust_kept_frac"] == pytest.approx(2 / 6)


def reference_weights(router, hidden_T_H: torch.Tensor, ids_T_K: torch.Tensor) -> torch.Tensor:
    """The weights a router gives experts ids_T_K, restated from transformers' router code (independent of R3's).

    Qwen-MoE: softmax(logits)[ids], renormalized when norm_topk_prob. GLM-4.5: sigmoid(logits)[ids] (the
    score-correction bias only ranks), over (sum + 1e-20) when norm_topk_prob, times routed_scaling_factor.
    """
    logits_T_E = torch.nn.functional.linear(hidden_T_H.reshape(-1, router.weight.shape[1]).float(), router.weight)
    if hasattr(router, "e_score_correction_bias"):
        weights_T_K = logits_T_E.sigmoid().gather(-1, ids_T_K)
        if router.norm_topk_prob:
            weights_T_K = weights_T_K / (weights_T_K.sum(-1, keepdim=True) + 1e-20)
        return weights_T_K * router.routed_scaling_factor
    weights_T_K = logits_T_E.softmax(-1).gather(-1, ids_T_K)
    return weights_T_K / weights_T_K.sum(-1, keepdim=True) if router.norm_topk_prob else weights_T_K


@pytest.mark.parametrize("random_tiny_path", ["qwen3_moe", "qwen2_moe", "glm4_moe"], indirect=True)
def test_replay_forces_exactly_the_recorded_experts(random_tiny_path):
    model = load_fp32(random_tiny_path)
    routers = find_routers(model)
    experts_inputs, router_inputs, handles = [], [], []
    for block in (m for m in model.modules() if any(getattr(m, "gate", None) is r for r in routers)):
        handles.append(block.experts.register_forward_pre_hook(lambda mod, a: experts_inputs.append((a[1], a[2]))))
        handles.append(block.gate.register_forward_pre_hook(lambda mod, a: router_inputs.append(a[0])))
    ids = torch.tensor([[3, 9, 27, 81, 5, 7]])
    gen = torch.Generator().manual_seed(0)
    routes_T_L_K = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6 * 2)]).view(6, 2, 2)
    ok_T = torch.tensor([True, True, False, True, True, True])
    with RouteRecorder(model) as rec:
        model(ids)
        native = rec.pop()
    experts_inputs.clear()
    router_inputs.clear()
    with RouteReplay(model) as replay:
        replay.set(routes_T_L_K, ok_T)
        model(ids)
        native_under_replay = replay.native()
    for handle in handles:
        handle.remove()
    # Native choices are measured while replaying; layer 0 sees the same input as without replay, later layers see
    # the replayed path.
    assert torch.equal(native_under_replay[:, 0], native[:, 0])
    assert len(experts_inputs) == len(router_inputs) == len(routers)
    for layer, ((index_T_K, weights_T_K), hidden) in enumerate(zip(experts_inputs, router_inputs, strict=True)):
        expected = torch.where(ok_T[:, None], routes_T_L_K[:, layer], native_under_replay[:, layer])
        assert torch.equal(index_T_K, expected)
        router = routers[layer]
        with torch.no_grad():
            _, own_weights_T_K, own_ids_T_K = router(hidden)  # outside the hooks: the model's own routing
        # The restated rule is the model's (its own picks), and replay weighs the replayed ids by it.
        torch.testing.assert_close(reference_weights(router, hidden, own_ids_T_K), own_weights_T_K)
        torch.testing.assert_close(weights_T_K, reference_weights(router, hidden, expected))
        torch.testing.assert_close(weights_T_K[~ok_T], own_weights_T_K[~ok_T])


def test_replay_weights_come_from_learner_logits_and_reach_a_trainable_router(random_qwen3_path):
    model = load_fp32(random_qwen3_path)
    router = find_routers(model)[0]
    router.weight.requires_grad_(True)
    ids = torch.tensor([[3, 9, 27, 81]])
    routes = torch.tensor([[[0, 1], [2, 3]]] * 4)
    with RouteReplay(model) as replay:
        replay.set(routes, torch.ones(4, dtype=torch.bool))
        model(ids).logits.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_routes_round_trip_through_the_ray_object_store():
    import ray

    from mint.rollout.engine import Completion, GroupRollout

    routes = torch.randint(0, 4, (3, 2, 2), dtype=torch.uint8)
    group = GroupRollout(
        torch.tensor([1, 2, 3]),
        torch.randint(0, 4, (2, 2, 2), dtype=torch.uint8),
        [Completion(torch.tensor([4, 5, 6]), torch.zeros(3), routes, "stop")],
    )
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        back = ray.get(ray.put(group))
    finally:
        if started:
            ray.shutdown()
    assert back.completions[0].routes_R_L_K.dtype == torch.uint8
    assert torch.equal(back.completions[0].routes_R_L_K, routes)
    assert torch.equal(back.prompt_routes_P1_L_K, group.prompt_routes_P1_L_K)


def test_a_nan_or_inf_log_prob_is_masked_non_finite_in_band_or_not_and_with_icepop_off():
    """Rollout log-probs NaN, -inf and +inf, and a learner log-prob NaN, next to two ordinary tokens. NaN compares
    false with both IcePop edges, so icepop_status calls it in band (0) and the mask kept it; with IcePop off nothing
    looked at it at all. Each must be dropped under its own reason, non_finite, whatever IcePop says, and the mismatch
    KL must stay finite."""
    nan, inf = math.nan, math.inf
    old = torch.tensor([-1.0, -1.0, -1.0, nan, -1.0, -1.2])
    rollout = torch.tensor([nan, -inf, inf, -1.0, -1.0, -1.0])
    route = torch.zeros(6, dtype=torch.long)
    status = icepop_status(old, rollout, 0.5, 5.0)
    assert status[0] == 0 and status[3] == 0  # the band test alone lets NaN through
    for ratio_status in (status, None):
        mask, counts = trust_mask(route, ratio_status, old, rollout)
        assert mask.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        assert counts.masked["non_finite"] == 4 and counts.kept == 2
        assert counts.kept + sum(counts.masked.values()) == counts.tokens
        assert math.isfinite(counts.mismatch_kl_sum)
        assert counts.metrics()["trust_dropped_non_finite"] == pytest.approx(4 / 6)
    # A missing route is counted first: each token has one reason.
    _, counts = trust_mask(torch.tensor([1, 0, 0, 0, 0, 0]), status, old, rollout)
    assert (counts.masked["route_missing"], counts.masked["non_finite"]) == (1, 3)


def test_dropped_fractions_group_the_reasons_into_causes():
    counts = TrustCounts(tokens=10, kept=3)
    counts.masked.update(route_missing=2, route_layers=1, route_duplicate=1, non_finite=1, ratio_low=1, ratio_high=1)
    assert counts.dropped() == pytest.approx(
        {"route_missing": 0.2, "route_mismatch": 0.2, "non_finite": 0.1, "icepop": 0.2}
    )
    assert sum(counts.dropped().values()) == pytest.approx(1 - counts.metrics()["trust_kept_frac"])
    assert TrustCounts().dropped() == dict.fromkeys(CAUSES, 0.0)
