"""sparse_latent_attention (DSA's gathered MLA attention) vs a dense masked oracle and the dense latent reference.

The oracle builds the whole key matrix [pages; own_pages], a boolean mask from the index, and runs plain softmax
attention with autograd: it shares no code with the op (no gather, no blocking, no hand-written backward).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import saved_bytes

from mint_kernels import latent_prefix_attention_reference, sparse_latent_attention

sla = importlib.import_module("mint_kernels.sparse_latent_attention")
H, DK, DV, SCALE = 4, 24, 16, 0.3
# fp64: the op and the oracle differ only in summation order over <= 64 keys and 24 columns of O(1) terms: ~1e-15.
# fp32 op vs fp64 oracle: a relative step of 6e-8 through a score (24-term dot), a softmax and a <= 64-term sum gives
# ~1e-6 on O(1) values; 1e-5 leaves a 10x margin. The fp32 buffer dpage_acc always gets 1e-5 for the same reason.
TOLS = {torch.float64: 1e-12, torch.float32: 1e-5}


def make_inputs(B, P, R, *, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = () if B is None else (B,)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return dict(q=rnd(*batch, H, R, DK), pages=rnd(P, DK), own_pages=rnd(*batch, R, DK))


def make_index(B, P, R, K, *, seed=0, dtype=torch.int64, drop=0.25):
    """Random causal selections [B?, R, K]: distinct keys among token r's P + r + 1 causal ones, min(K, P + r + 1) of
    them (every causal key when K is larger), then a random `drop` share of the slots emptied (-1), keeping at least
    one; slots shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(1 if B is None else B):
        for r in range(R):
            n = P + r + 1
            chosen = torch.randperm(n, generator=g)[: min(K, n)]
            keep = torch.rand(len(chosen), generator=g) >= drop
            keep[0] = True
            slots = torch.full((K,), -1, dtype=torch.int64)
            slots[: int(keep.sum())] = chosen[keep]
            rows.append(slots[torch.randperm(K, generator=g)])
    index = torch.stack(rows).view(*(() if B is None else (B,)), R, K)
    return index.to(dtype)


def backward_of(out, lse, row=None, batch=2):
    """Backward of sum(out * gO) + sum(lse * gL) with fixed random gO, gL: gradients flow from both outputs. With row,
    out and lse are that batch row of a batch-`batch` run, and gO, gL that run's rows."""
    g = torch.Generator().manual_seed(1)
    lead = () if row is None else (batch,)
    g_out = torch.randn(*lead, *out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(*lead, *lse.shape, generator=g, dtype=torch.float64)
    if row is not None:
        g_out, g_lse = g_out[row], g_lse[row]
    ((out.double() * g_out).sum() + (lse.double() * g_lse).sum()).backward()


def dense_oracle(q, pages, own_pages, index, dv, scale):
    """[pages; own] as one key matrix, mask[b, r, j] = j in index[b, r], masked softmax; returns out, lse."""
    batched = q.dim() == 4
    q4, own, idx = (q, own_pages, index) if batched else (q[None], own_pages[None], index[None])
    B, _, R, _ = q4.shape
    keys = torch.cat([pages.expand(B, *pages.shape), own], dim=1)  # [B, P + R, D_k]
    mask = torch.zeros(B, R, keys.shape[1] + 1, dtype=torch.bool)
    mask.scatter_(2, torch.where(idx >= 0, idx, keys.shape[1]).long(), True)  # -1 lands in a dropped extra column
    s = (q4 @ keys[:, None].transpose(-1, -2)) * scale
    s = s.masked_fill(~mask[:, None, :, :-1], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ keys[:, None, :, :dv]
    return (out, lse) if batched else (out[0], lse[0])


def run(fn, inputs, index, *, dtype, acc_init=None, row=None):
    """Forward (out, lse) and backward in dtype; every input requires grad. With acc_init the op gets a copy of it as
    dpage_acc and the result is returned as dpages; otherwise dpages is the pages' autograd gradient."""
    ins = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.items()}
    extra = {} if acc_init is None else {"dpage_acc": acc_init.clone()}
    out, lse = fn(**ins, index=index, **extra)
    backward_of(out, lse, row)
    dpages = extra["dpage_acc"] if acc_init is not None else ins["pages"].grad
    if acc_init is not None:
        assert ins["pages"].grad is None  # the buffer took the prefix gradient, autograd none
    return {"out": out, "lse": lse, "dq": ins["q"].grad, "d_own": ins["own_pages"].grad, "dpages": dpages}


def ours(**kw):
    return sparse_latent_attention(**kw, latent_dim=DV, scale=SCALE, return_lse=True)


def oracle(**kw):
    return dense_oracle(**kw, dv=DV, scale=SCALE)


def assert_match(got, want, tol, buffer_tol=None):
    assert got.keys() == want.keys()
    for name, w in want.items():
        t = buffer_tol if name == "dpages" and buffer_tol is not None else tol
        torch.testing.assert_close(got[name].double(), w.double(), atol=t, rtol=t, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("K", [3, 8, 64], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("R", [1, 9], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("P", [0, 7, 40], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("B", [None, 2], ids=["unbatched", "B2"])
def test_matches_dense_oracle(B, P, R, K, dtype, monkeypatch):
    """out, lse, dq, d_own and the pages' autograd gradient vs the dense masked oracle in fp64. One token per block
    when R = 9 (nine blocks, each its own gather and scatter), one block for R = 1; int32 index for the batched case."""
    if R > 1:
        monkeypatch.setattr(sla, "BLOCK_ELEMENTS", 1)
    inputs = make_inputs(B, P, R, seed=P + R + K)
    index = make_index(B, P, R, K, seed=K, dtype=torch.int32 if B else torch.int64)
    got = run(ours, inputs, index, dtype=dtype)
    want = run(oracle, inputs, index, dtype=torch.float64)
    assert_match(got, want, TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_dpage_acc_adds_into_a_view(dtype, monkeypatch):
    """The buffer is a strided view of a larger fp32 tensor with prior content: the prefix gradient is ADDED (prior
    content + oracle gradient), nothing outside the view changes, and autograd gets no pages gradient even though the
    pages require grad. Also q and own_pages as non-contiguous views. Token blocks of 4 (R = 9: a partial last one)."""
    monkeypatch.setattr(sla, "BLOCK_ELEMENTS", 4 * 2 * 8 * DK)  # B * Rb * K * max(D_k, H) with Rb = 4
    B, P, R, K = 2, 40, 9, 8
    inputs = make_inputs(B, P, R, seed=3)
    inputs["q"] = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, R, D_k] with token-major strides
    index = make_index(B, P, R, K, seed=4)
    big = torch.randn(3, DK, P + 5, generator=torch.Generator().manual_seed(5))
    before = big.clone()
    acc = big[1, :, 2 : 2 + P].T  # [P, D_k], non-contiguous
    prior = acc.clone()

    def ours_into_view(dpage_acc, **kw):
        assert dpage_acc.shape == acc.shape
        return ours(**kw, dpage_acc=acc)

    got = run(ours_into_view, inputs, index, dtype=dtype, acc_init=torch.zeros(P, DK))
    want = run(oracle, inputs, index, dtype=torch.float64)
    want["dpages"] = prior.double() + want["dpages"]
    assert_match(got | {"dpages": acc}, want, TOLS[dtype], buffer_tol=1e-5)
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[1, :, 2 : 2 + P] = False
    assert torch.equal(big[outside], before[outside])


def test_batch_rows_sum_their_prefix_gradient_into_one_buffer():
    """B = 2 into one buffer equals each batch row run alone (unbatched) into its own buffer, the two summed; the
    other outputs and gradients equal the per-row runs."""
    B, P, R, K = 2, 40, 9, 8
    inputs, index = make_inputs(B, P, R, seed=6), make_index(B, P, R, K, seed=7)
    both = run(ours, inputs, index, dtype=torch.float64, acc_init=torch.zeros(P, DK))
    rows = [
        run(ours, {"q": inputs["q"][b], "pages": inputs["pages"], "own_pages": inputs["own_pages"][b]}, index[b],
            dtype=torch.float64, acc_init=torch.zeros(P, DK), row=b)
        for b in range(B)
    ]  # fmt: skip
    assert rows[0]["dpages"].abs().sum() > 0 and rows[1]["dpages"].abs().sum() > 0
    want = {name: torch.stack([row[name] for row in rows]) for name in ("out", "lse", "dq", "d_own")}
    want["dpages"] = rows[0]["dpages"] + rows[1]["dpages"]
    assert_match(both, want, 1e-12, buffer_tol=1e-6)  # the buffer is fp32: two fp32 sums in different orders


@pytest.mark.parametrize("B,P,R", [(None, 40, 9), (2, 7, 9), (2, 0, 5)], ids=["unbatched", "batched", "p0"])
def test_every_causal_key_equals_dense_latent_reference(B, P, R):
    """Selecting all P + r + 1 causal keys of each token (shuffled, padded with -1 to K = 64) is dense latent prefix
    attention: out, lse, dq, d_own and the dpage_acc buffer equal latent_prefix_attention_reference's."""
    inputs = make_inputs(B, P, R, seed=8)
    index = make_index(B, P, R, 64, seed=9, drop=0.0)
    assert ((index >= 0).sum(-1) == P + 1 + torch.arange(R)).all()  # every causal key, nothing else
    init = torch.randn(P, DK, generator=torch.Generator().manual_seed(10))

    def dense(index, **kw):
        return latent_prefix_attention_reference(**kw, latent_dim=DV, scale=SCALE, return_lse=True)

    got = run(ours, inputs, index, dtype=torch.float64, acc_init=init)
    want = run(dense, inputs, index, dtype=torch.float64, acc_init=init)
    assert_match(got, want, 1e-12, buffer_tol=1e-6)  # the buffers are fp32, the same sums in different orders


def test_gradcheck_float64():
    """Finite-difference check of out and lse w.r.t. q, pages and own_pages (through autograd), with -1 slots."""
    inputs = make_inputs(2, 5, 4, seed=11)
    args = tuple(t.detach()[..., :6].contiguous().requires_grad_() for t in inputs.values())  # D_k = 6
    index = make_index(2, 5, 4, 3, seed=12)
    fn = lambda q, p, o: sparse_latent_attention(q, p, o, index, 4, 0.4, return_lse=True)
    assert torch.autograd.gradcheck(fn, args)


def test_token_with_only_empty_slots_gives_zero_and_no_nan():
    """A token whose slots are all -1 (outside the caller's contract, but defined): out 0, lse -inf, gradients 0 for
    it, and the other tokens unchanged."""
    inputs, index = make_inputs(None, 7, 3, seed=13), make_index(None, 7, 3, 4, seed=14)
    got = run(ours, inputs, index, dtype=torch.float64, acc_init=torch.zeros(7, DK))
    index[1] = -1
    inputs["q"].requires_grad_()
    out, lse = sparse_latent_attention(**inputs, index=index, latent_dim=DV, scale=SCALE, return_lse=True)
    out.sum().backward()
    assert (out[:, 1] == 0).all() and (lse[:, 1] == float("-inf")).all() and (inputs["q"].grad[:, 1] == 0).all()
    torch.testing.assert_close(out[:, [0, 2]], got["out"][:, [0, 2]], atol=1e-12, rtol=1e-12)
    assert torch.isfinite(inputs["q"].grad).all()


@pytest.mark.parametrize("mode", ["constant-pages", "dpage_acc", "pages-require-grad"])
def test_saves_nothing_prefix_sized(mode, monkeypatch):
    """What autograd saves is the same for P = 8 and P = 4096 (q, own_pages, index, out, lse), and no gathered key
    block exceeds BLOCK_ELEMENTS (Rb = 1 for the smallest budget)."""
    R, K = 16, 8
    monkeypatch.setattr(sla, "BLOCK_ELEMENTS", 4 * K * DK)  # 4 tokens' keys per block
    largest = []
    real_gather = sla._gather_keys

    def recording_gather(*args):
        keys, *rest = real_gather(*args)
        largest.append(keys.numel())
        return keys, *rest

    monkeypatch.setattr(sla, "_gather_keys", recording_gather)

    def saved(P):
        inputs = make_inputs(None, P, R, dtype=torch.float32, seed=P)
        inputs = {k: v.requires_grad_(k != "pages" or mode == "pages-require-grad") for k, v in inputs.items()}
        acc = {"dpage_acc": torch.zeros(P, DK)} if mode == "dpage_acc" else {}
        index = make_index(None, P, R, K, seed=P)
        run_once = lambda: ours(**inputs, index=index, **acc)[0].sum().backward()
        return saved_bytes(run_once)

    small, large = saved(8), saved(4096)
    assert small == large, (small, large)
    assert large == 4 * (H * R * DK + R * DK + H * R * DV + H * R) + 8 * R * K  # q, own, out, lse fp32; index int64
    assert max(largest) == 4 * K * DK


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(index=torch.zeros(2, 5, 3, dtype=torch.long)), "index must be"),  # R = 5, q has 4
        (dict(index=torch.zeros(3, 4, 3, dtype=torch.long)), "index must be"),  # B = 3, q has 2
        (dict(index=torch.zeros(4, 3, dtype=torch.long)), "index must be"),  # unbatched index, batched q
        (dict(index=torch.zeros(2, 4, 3)), "int32 or int64"),
        (dict(own_pages=torch.zeros(2, 5, DK)), "disagree"),
        (dict(pages=torch.zeros(7, DK + 1)), "disagree"),
        (dict(latent_dim=DK + 1), "latent_dim"),
        (dict(dpage_acc=torch.zeros(7, DK, dtype=torch.float64)), "dpage_acc"),
    ],
    ids=["index-R", "index-B", "index-rank", "index-float", "own-R", "pages-Dk", "latent-dim", "acc-dtype"],
)
def test_mismatched_shapes_raise_one_line_value_error(change, match):
    args = make_inputs(2, 7, 4) | dict(index=make_index(2, 7, 4, 3), latent_dim=DV, scale=SCALE) | change
    with pytest.raises(ValueError, match=match) as err:
        sparse_latent_attention(**args)
    assert "\n" not in str(err.value)
