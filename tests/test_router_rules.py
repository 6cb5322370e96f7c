"""R3 weighs replayed routes by each router's own rule: every router class Mint accepts against its own forward.

The rule used to be guessed from attributes: a router without `norm_topk_prob` was taken as not renormalizing, and one
without `e_score_correction_bias` as softmax. Qwen3.5-MoE's router always renormalizes and has no such attribute
(its replayed weights came out about 0.25 off), and MiniMax-M2's router is a sigmoid router whose bias lives on its
block (it got softmax weights). Each class now has its rule in `ROUTER_RULES`, read off its forward, and a class
without one is refused.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteTopkRouter
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

from longstraw.errors import LongStrawError
from longstraw.router_rules import ROUTER_RULES, replay_weights
from longstraw.routing import RouteRecorder, RouteReplay
from mint.errors import ConfigError
from mint.train.preflight import check_route_replay

H, E, K, T = 16, 8, 3, 64
MOE = dict(hidden_size=H, num_experts_per_tok=K)

# (router class, its family's config) for every class in ROUTER_RULES, with each value of the flag it reads.
ROUTERS = [
    *[(Qwen2MoeTopKRouter, transformers.Qwen2MoeConfig(**MOE, num_experts=E, norm_topk_prob=f)) for f in (True, False)],
    *[(Qwen3MoeTopKRouter, transformers.Qwen3MoeConfig(**MOE, num_experts=E, norm_topk_prob=f)) for f in (True, False)],
    *[
        (Qwen3NextTopKRouter, transformers.Qwen3NextConfig(**MOE, num_experts=E, norm_topk_prob=f))
        for f in (True, False)
    ],
    (Qwen3_5MoeTopKRouter, transformers.Qwen3_5MoeTextConfig(**MOE, num_experts=E)),
    *[
        (
            Glm4MoeTopkRouter,
            transformers.Glm4MoeConfig(
                **MOE, n_routed_experts=E, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=f
            ),
        )
        for f in (True, False)
    ],
    (MiniMaxM2TopKRouter, transformers.MiniMaxM2Config(**MOE, num_local_experts=E)),
    *[
        (
            cls,
            config_cls(**MOE, n_routed_experts=E, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=f),
        )
        for cls, config_cls in (
            (DeepseekV3TopkRouter, transformers.DeepseekV3Config),
            (Glm4MoeLiteTopkRouter, transformers.Glm4MoeLiteConfig),
            (DeepseekV32TopkRouter, transformers.DeepseekV32Config),
            (GlmMoeDsaTopkRouter, transformers.GlmMoeDsaConfig),
        )
        for f in (True, False)
    ],
]


def _router_and_output(cls, config, seed: int = 0):
    """A router with random weights (and a random score-correction bias where it has one), and its own forward's
    (logits, weights, ids) over random hidden states."""
    gen = torch.Generator().manual_seed(seed)
    router = cls(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    hidden_T_H = torch.randn(T, H, generator=gen)
    if cls is MiniMaxM2TopKRouter:  # its block holds the bias and passes it in
        return router, router(hidden_T_H, torch.randn(E, generator=gen))
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.copy_(torch.randn(E, generator=gen))
    return router, router(hidden_T_H)


def test_every_router_class_with_a_rule_is_tested_here():
    assert {cls.__name__ for cls, _ in ROUTERS} == set(ROUTER_RULES)


@pytest.mark.parametrize(
    ("cls", "config"), ROUTERS, ids=[f"{c.__name__}-{getattr(cfg, 'norm_topk_prob', 'always')}" for c, cfg in ROUTERS]
)
def test_replayed_weights_of_the_routers_own_ids_are_its_own_weights(cls, config):
    router, (logits_T_E, weights_T_K, ids_T_K) = _router_and_output(cls, config)
    replayed_T_K = replay_weights(router, logits_T_E, ids_T_K)
    # fp32 softmax/sigmoid of the same logits, a k-term sum and one division: a few ulps apart at most.
    torch.testing.assert_close(replayed_T_K, weights_T_K, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-7)


@pytest.mark.parametrize(("cls", "config"), ROUTERS[:1] + ROUTERS[6:7])
def test_route_replay_makes_the_router_return_the_recorded_ids_with_their_own_rule(cls, config):
    """Under RouteReplay a router returns the recorded ids (here another seed's choice) weighed by its rule."""
    router, _ = _router_and_output(cls, config)
    model = nn.ModuleDict({"gate": router})
    _, (_, _, other_ids_T_K) = _router_and_output(cls, config, seed=1)
    hidden_T_H = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    with RouteReplay(model) as replay:
        replay.set(other_ids_T_K.unsqueeze(1), torch.ones(T, dtype=torch.bool))
        logits_T_E, weights_T_K, ids_T_K = router(hidden_T_H)
    assert torch.equal(ids_T_K, other_ids_T_K)
    torch.testing.assert_close(weights_T_K, replay_weights(router, logits_T_E, other_ids_T_K))


class FooTopKRouter(nn.Module):
    """A router of a family route replay has no rule for: it returns the (logits, weights, ids) triple."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H))

    def forward(self, hidden_T_H):
        logits_T_E = hidden_T_H @ self.weight.T
        weights_T_K, ids_T_K = logits_T_E.softmax(-1).topk(K, dim=-1)
        return logits_T_E, weights_T_K, ids_T_K


def test_a_router_without_a_rule_is_recorded_but_never_replayed():
    model = nn.ModuleDict({"gate": FooTopKRouter()})
    with RouteRecorder(model) as recorder:
        model["gate"](torch.randn(T, H))
        assert recorder.pop().shape == (T, 1, K)
    with pytest.raises(LongStrawError, match=r"^FooTopKRouter: route replay does not know .*grpo\.r3 = false"):
        RouteReplay(model)


def test_preflight_refuses_route_replay_on_a_base_whose_router_has_no_rule():
    small = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    gpt_oss = transformers.GptOssConfig(**small, num_local_experts=E, num_experts_per_tok=K)
    with pytest.raises(ConfigError) as err:
        check_route_replay(gpt_oss)
    assert str(err.value).startswith("grpo.r3: GptOssTopKRouter: route replay does not know")
    assert "\n" not in str(err.value)
    check_route_replay(transformers.Qwen3_5MoeTextConfig(**small, num_experts=E, num_experts_per_tok=K))
    check_route_replay(transformers.Qwen3Config(**small))  # dense: no routers, nothing to replay
