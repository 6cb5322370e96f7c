"""The rollout engine's indexer records on the DSA families (DeepSeek-V3.2, GLM-5): each completion's
`indexer_R_I_K` equals the selections a teacher-forced HF forward over prompt + response makes at the same queries."""

from __future__ import annotations

import pytest
import torch
from test_rollout import PROMPT
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

from mint.errors import MintError
from mint.models.specs import tiny_config
from mint.rollout._indexer import find_indexers
from mint.rollout.engine import RolloutEngine, SamplingParams

DSA_FAMILIES = ["deepseek_v32", "glm_moe_dsa"]
TOP_K = 4
# Different lengths (left pads 0, 4 and 2 in the decode slab; 2 in the first prefill chunk), PROMPT twice (prefilled
# once, two groups decode it); prefill_tokens 10 packs [1, 2, 3] and the 5-token prompt into one chunk.
PROMPTS = [PROMPT, [1, 2, 3], [9, 8, 7, 6, 5], PROMPT]
# Relative gap under which two indexer scores at the top-k cut count as a tie: the engine's batched, cached forward
# and the reference's single uncached one sum in another order, ~1e-6 relative in fp32; 1e-4 leaves a wide margin.
TIE_RTOL = 1e-4


def _tiny(family: str, **overrides) -> torch.nn.Module:
    """A random fp32 tiny base; its 1-D parameters (norm weights, router biases) get noise so they differ per layer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, 97, initializer_range=0.05, **overrides))
    model = model.to(torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module", params=DSA_FAMILIES)
def dsa_model(request):
    """index_topk 4, below every sequence here, so the selection matters; 8 indexer heads so that a key's score (a
    weighted sum of 8 ReLU'd head scores) is rarely exactly 0, where ties would make the selection arbitrary."""
    return _tiny(request.param, index_topk=TOP_K, index_n_heads=8)


class _TopkScores(TorchFunctionMode):
    """Records the tensor each indexer calls `.topk` on (its masked scores [B, S, T]) while `layer` is set."""

    def __init__(self):
        super().__init__()
        self.layer: int | None = None
        self.scores: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.layer is not None and func is torch.Tensor.topk:
            self.scores[self.layer] = args[0].detach().clone()
        return func(*args, **(kwargs or {}))


def _teacher_forced(model, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One uncached HF forward of `ids`: per indexer layer, its selections [S, K_hf] and masked scores [S, S]."""
    indexers = find_indexers(model)
    selections: list[torch.Tensor | None] = [None] * len(indexers)
    mode = _TopkScores()

    def pre_hook(index):
        def hook(module, args):
            mode.layer = index

        return hook

    def hook(index):
        def hook(module, args, output):
            selections[index] = output[0]
            mode.layer = None

        return hook

    handles = [m.register_forward_pre_hook(pre_hook(i)) for i, m in enumerate(indexers)]
    handles += [m.register_forward_hook(hook(i)) for i, m in enumerate(indexers)]
    try:
        with torch.inference_mode(), mode:
            model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return selections, [mode.scores[i][0] for i in range(len(indexers))]


def _expected_row(selection_K: torch.Tensor, query: int) -> torch.Tensor:
    """HF's key indices for the query at `query` -> absolute positions, future ones -1, padded to TOP_K, sorted."""
    positions = torch.where(selection_K.long() <= query, selection_K.long(), -1)
    positions = torch.cat([positions, positions.new_full((TOP_K - positions.numel(),), -1)])
    return positions.sort().values.to(torch.int32)


def _tied_at_cut(scores_T: torch.Tensor) -> bool:
    """Whether the TOP_K-th and next best scores of one query are too close to order the same way in both forwards."""
    if scores_T.numel() <= TOP_K:
        return False
    top = scores_T.topk(TOP_K + 1).values
    kth, next_ = top[TOP_K - 1], top[TOP_K]
    if torch.isinf(kth) or torch.isinf(next_):  # fewer than K+1 causal keys: every causal key is selected
        return False
    return bool(kth - next_ <= TIE_RTOL * max(kth.abs(), next_.abs(), 1.0))


def _stop_ids_for_first_group(model, params: SamplingParams, seed: int) -> tuple[int, ...]:
    """Token ids that end group 0's rows at their first token and appear in no other group's tokens (a group's draws
    do not depend on the others, so the other groups run on and group 0 leaves the batch)."""
    groups = RolloutEngine(model, eos_token_ids=[]).generate(PROMPTS, 2, params, seed=seed)
    others = {t for group in groups[1:] for c in group.completions for t in c.tokens_R.tolist()}
    stop = {int(c.tokens_R[0]) for c in groups[0].completions} - others
    assert stop, "group 0's first tokens all occur in the other groups"
    return tuple(sorted(stop))


def test_indexer_records_match_teacher_forced_selection(dsa_model):
    """Sampled (T = 1, seeded), 4 groups of G = 2 over prompts of 3, 5 and 7 tokens (left pads in the prefill chunk
    and the slab; one prompt twice, prefilled once), group 0 stopping at its first token so the slab is compacted:
    every row j of every completion's indexer_R_I_K [R, I, K] equals the teacher-forced HF forward's selection at the
    query P-1+j (absolute, future keys -1, sorted), for every indexer layer; rows where a score ties at the top-k cut
    (relative gap <= TIE_RTOL) are skipped, and at least 90% of rows are compared."""
    params = SamplingParams(temperature=1.0, max_tokens=6)
    stop = _stop_ids_for_first_group(dsa_model, params, seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=stop)
    engine = RolloutEngine(dsa_model, eos_token_ids=[], prefill_tokens=10, record_indexer=True)
    groups = engine.generate(PROMPTS, 2, params, seed=5)
    num_indexers = {"deepseek_v32": 3, "glm_moe_dsa": 2}[dsa_model.config.model_type]
    assert len(groups[0].completions[0].tokens_R) == 1 and len(groups[1].completions[0].tokens_R) > 1

    compared = total = minus_ones = 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for completion in group.completions:
            length = completion.tokens_R.numel()
            records_R_I_K = completion.indexer_R_I_K
            assert records_R_I_K.shape == (length, num_indexers, TOP_K) and records_R_I_K.dtype == torch.int32
            owned = records_R_I_K.untyped_storage().nbytes() == records_R_I_K.numel() * 4
            assert records_R_I_K.device.type == "cpu" and owned, "a view would pickle the whole batch buffer"
            ids = prompt + completion.tokens_R[:-1].tolist()
            selections, scores = _teacher_forced(dsa_model, ids)
            for row in range(length):
                query = len(prompt) - 1 + row
                total += 1
                if any(_tied_at_cut(layer_scores[query]) for layer_scores in scores):
                    continue
                expected_I_K = torch.stack([_expected_row(sel[query], query) for sel in selections])
                assert torch.equal(records_R_I_K[row], expected_I_K), (prompt, row)
                minus_ones += int((expected_I_K == -1).sum())
                compared += 1
    assert compared >= 0.9 * total, f"only {compared} of {total} rows free of ties at the cut"
    assert minus_ones > 0, "no query had fewer than K keys: the -1 convention went untested"


def test_recording_leaves_tokens_logprobs_routes_unchanged(dsa_model):
    """The same seeded sampled rollout with and without record_indexer: identical tokens, logprobs, routes and prompt
    routes (recording only reads the indexers' outputs); without it the records are None and no hook stays behind."""
    params = SamplingParams(temperature=1.0, max_tokens=6)
    plain = RolloutEngine(dsa_model, eos_token_ids=[], prefill_tokens=10).generate(PROMPTS, 2, params, seed=7)
    recorded = RolloutEngine(dsa_model, eos_token_ids=[], prefill_tokens=10, record_indexer=True)
    recorded = recorded.generate(PROMPTS, 2, params, seed=7)
    for a, b in zip(plain, recorded, strict=True):
        assert torch.equal(a.prompt_routes_P1_L_K, b.prompt_routes_P1_L_K)
        for x, y in zip(a.completions, b.completions, strict=True):
            assert torch.equal(x.tokens_R, y.tokens_R)
            assert torch.equal(x.logprobs_R, y.logprobs_R)
            assert torch.equal(x.routes_R_L_K, y.routes_R_L_K)
            assert x.indexer_R_I_K is None and y.indexer_R_I_K is not None
    assert all(not m._forward_hooks for m in find_indexers(dsa_model))


def test_record_indexer_refuses_a_model_without_indexers():
    """DeepSeek-V3 (MLA without DSA) has no indexer: record_indexer=True raises a one-line MintError."""
    model = _tiny("deepseek_v3")
    with pytest.raises(MintError) as info:
        RolloutEngine(model, eos_token_ids=[], record_indexer=True)
    assert "\n" not in str(info.value) and "indexer" in str(info.value)
    group = RolloutEngine(model, eos_token_ids=[]).generate([PROMPT], 2, SamplingParams(max_tokens=2), seed=0)[0]
    assert all(c.indexer_R_I_K is None for c in group.completions)
