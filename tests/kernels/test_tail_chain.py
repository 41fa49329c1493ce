"""tail_chain: Triton kernel (interpreter on CPU) vs the torch reference; greedy walk, q semantics, draws."""

from __future__ import annotations

import importlib

import pytest
import torch

tc = importlib.import_module("dspine.kernels.tail_chain")


@pytest.fixture
def triton_ready(kernel_module):
    """Fails (never skips) when the Triton kernels cannot run here (CPU without TRITON_INTERPRET=1)."""
    kernel_module("tail_chain")


needs_triton = pytest.mark.usefixtures("triton_ready")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(nb, t, k, seed=42):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(nb, t, k, k, generator=g) * 2
    cand = torch.stack([torch.randperm(1000, generator=g)[:k] for _ in range(nb * t)]).view(nb, t, k)
    # a mix of greedy, plain, top-k, top-p and both
    temps = [0.0, 1.0, 0.7, 1.3, 0.5]
    topks = [0, 0, 3, 0, 2]
    topps = [1.0, 1.0, 1.0, 0.6, 0.9]
    temperature = torch.tensor([temps[i % 5] for i in range(nb)], dtype=torch.float64)
    top_k = torch.tensor([topks[i % 5] for i in range(nb)], dtype=torch.int64)
    top_p = torch.tensor([topps[i % 5] for i in range(nb)], dtype=torch.float64)
    u = torch.rand(nb, t, generator=g, dtype=torch.float64)
    return scores, cand, temperature, top_k, top_p, u


def brute_force_greedy(scores, cand):
    nb, t, k, _ = scores.shape
    ids = torch.empty(nb, t, dtype=torch.int64)
    for n in range(nb):
        j = 0
        for r in range(t):
            row = scores[n, r, j].tolist()
            best = max(range(k), key=lambda s: (row[s], -s))  # ties to the lower slot
            ids[n, r] = cand[n, r, best]
            j = best
    return ids


@needs_triton
@pytest.mark.parametrize("nb,t,k", [
    pytest.param(1, 1, 1, id="nb1-t1-k1"),
    pytest.param(3, 5, 6, id="nb3-t5-k6"),
    pytest.param(5, 15, 16, id="nb5-t15-k16"),
    pytest.param(7, 3, 17, id="nb7-t3-k17"),
])
def test_tail_chain_triton_matches_ref(nb, t, k, assert_close):
    args = [a.to(DEV) for a in make_case(nb, t, k)]
    ref = tc.tail_chain_ref(*args)
    out = tc.tail_chain_triton(*args)
    assert torch.equal(out[1].cpu(), ref[1].cpu()), "choices differ"
    assert torch.equal(out[0].cpu(), ref[0].cpu()), "draft ids differ"
    assert out[2].dtype == torch.float64
    assert_close("q", ref[2], out[2], 1e-12)


@needs_triton
def test_tail_chain_ties_to_lower_slot():
    scores = torch.zeros(2, 3, 4, 4)
    scores[:, :, :, 1] = 1.0
    scores[:, :, :, 3] = 1.0  # slots 1 and 3 tie for the max
    cand = torch.arange(12).view(1, 3, 4).expand(2, 3, 4).contiguous()
    temperature = torch.zeros(2, dtype=torch.float64)
    top_k = torch.tensor([0, 1])
    top_p = torch.ones(2, dtype=torch.float64)
    u = torch.zeros(2, 3, dtype=torch.float64)
    for fn in (tc.tail_chain_ref, tc.tail_chain_triton):
        _, choice, q = fn(scores.to(DEV), cand.to(DEV), temperature.to(DEV), top_k.to(DEV), top_p.to(DEV), u.to(DEV))
        assert choice.cpu().eq(1).all()
        assert q.cpu()[..., 1].eq(1).all() and q.cpu().sum(-1).eq(1).all()
    # sampled with top_k=1: the kept slot of the tie is the lower one too
    temperature = torch.ones(2, dtype=torch.float64)
    u = torch.full((2, 3), 0.99, dtype=torch.float64)
    for fn in (tc.tail_chain_ref, tc.tail_chain_triton):
        _, choice, q = fn(scores.to(DEV), cand.to(DEV), temperature.to(DEV), top_k.to(DEV), top_p.to(DEV), u.to(DEV))
        assert choice.cpu()[1].eq(1).all() and q.cpu()[1, :, 1].eq(1).all()


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_greedy_chain_equals_brute_force_walk(impl, request):
    if impl == "triton":
        request.getfixturevalue("triton_ready")
    scores, cand, _, _, _, u = make_case(4, 15, 16)
    nb = scores.shape[0]
    fn = tc.tail_chain_ref if impl == "ref" else tc.tail_chain_triton
    zeros = torch.zeros(nb, dtype=torch.float64)
    ids, choice, q = fn(scores.to(DEV), cand.to(DEV), zeros.to(DEV), torch.zeros(nb, dtype=torch.int64).to(DEV),
                        torch.ones(nb, dtype=torch.float64).to(DEV), u.to(DEV))
    assert torch.equal(ids.cpu(), brute_force_greedy(scores, cand))
    assert torch.equal(q.cpu(), torch.nn.functional.one_hot(choice.cpu(), 16).double())


def test_sampled_q_is_sampling_probabilities_of_the_walked_rows():
    sampling = pytest.importorskip("dspine.replica.sampling")
    scores, cand, temperature, top_k, top_p, u = make_case(10, 6, 16)
    ids, choice, q = tc.tail_chain_ref(scores, cand, temperature, top_k, top_p, u)
    torch.testing.assert_close(q.sum(-1), torch.ones(10, 6, dtype=torch.float64), rtol=0, atol=1e-12)
    for n in range(10):
        j = 0
        for r in range(6):
            p = sampling.probabilities(scores[n, r, j][None].double(), temperature[n:n + 1], top_k[n:n + 1],
                                       top_p[n:n + 1])[0]
            torch.testing.assert_close(q[n, r], p, rtol=0, atol=1e-12)
            assert torch.equal((q[n, r] > 0), (p > 0)), "kept sets differ"  # zeros exactly where filtered
            slot = int(sampling.sample(p[None], u[n, r:r + 1])[0])
            assert slot == int(choice[n, r]) and q[n, r, slot] > 0
            j = slot


def test_same_uniforms_same_chain():
    args = make_case(6, 15, 16)
    a = tc.tail_chain_ref(*args)
    b = tc.tail_chain_ref(*args)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_sampled_draw_frequencies_match_q():
    """N copies of one block, different coins: empirical frequencies of rows 1 and 2 vs q.
    (Run on the reference; the kernel equals it draw for draw, see test_tail_chain_triton_matches_ref.)"""
    impl, n = "ref", 4000
    scores, cand, *_ = make_case(1, 2, 6)
    scores = scores.expand(n, 2, 6, 6).contiguous()
    cand = cand.expand(n, 2, 6).contiguous()
    temperature = torch.full((n,), 0.8, dtype=torch.float64)
    top_k = torch.full((n,), 5, dtype=torch.int64)
    top_p = torch.full((n,), 0.95, dtype=torch.float64)
    u = torch.rand(n, 2, generator=torch.Generator().manual_seed(42), dtype=torch.float64)
    fn = tc.tail_chain_ref if impl == "ref" else tc.tail_chain_triton
    _, choice, q = (t.cpu() for t in fn(scores.to(DEV), cand.to(DEV), temperature.to(DEV), top_k.to(DEV),
                                       top_p.to(DEV), u.to(DEV)))
    freq1 = torch.bincount(choice[:, 0], minlength=6).double() / n
    tol = 4 * (0.25 / n) ** 0.5  # 4 sigma of a Bernoulli frequency
    assert (freq1 - q[0, 0]).abs().max() < tol
    assert (freq1[q[0, 0] == 0] == 0).all()
    j = int(torch.mode(choice[:, 0]).values)  # condition row 2 on the most common row-1 slot
    sel = choice[:, 0] == j
    freq2 = torch.bincount(choice[sel, 1], minlength=6).double() / sel.sum()
    assert (freq2 - q[sel][0, 1]).abs().max() < 4 * (0.25 / sel.sum()) ** 0.5


def test_unfiltered_batch_skips_the_sort_and_draws_the_same_chain():
    """A batch where no sampled block cuts by top-k / top-p takes the sort-free softmax; it must draw
    exactly what the sorted path draws (greedy blocks in the same batch stay argmax walks)."""
    scores, cand, _, _, _, u = make_case(6, 15, 32, seed=7)
    temperature = torch.tensor([0.7, 0.0, 1.0, 0.7, 1.3, 0.0], dtype=torch.float64)
    top_k = torch.tensor([0, 5, 0, 32, 0, 0])  # top_k >= K keeps every candidate; greedy blocks ignore it
    top_p = torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    assert tc._filters_inactive(temperature, top_k, top_p, 32)
    fast = tc.tail_chain_ref(scores, cand, temperature, top_k, top_p, u)
    # the same table rows through the sorted path's q
    nb, t, k, _ = scores.shape
    rows = scores.reshape(nb * t * k, k).double()
    q_sorted = tc._row_q(rows, temperature.repeat_interleave(t * k), top_k.repeat_interleave(t * k),
                         top_p.repeat_interleave(t * k))
    q_fast = tc._row_q_unfiltered(rows, temperature.repeat_interleave(t * k))
    torch.testing.assert_close(q_fast, q_sorted, rtol=0, atol=1e-14)
    assert torch.equal(q_fast > 0, q_sorted > 0), "kept sets differ"
    ids, choice, q = fast
    assert torch.equal(ids[[1, 5]], brute_force_greedy(scores[[1, 5]], cand[[1, 5]]))
    assert torch.equal(q[[1, 5]], torch.nn.functional.one_hot(choice[[1, 5]], k).double())
    # every sampled row's slot is the inverse-CDF draw of its walked row of q
    for n in (0, 2, 3, 4):
        j = 0
        for r in range(t):
            cdf = q_sorted.view(nb, t, k, k)[n, r, j].cumsum(0)
            expect = min(int((cdf <= u[n, r] * cdf[-1]).sum()), int((cdf.diff(prepend=cdf.new_zeros(1)) > 0).nonzero().max()))
            assert int(choice[n, r]) == expect
            j = expect


def test_filtered_batch_keeps_the_sorted_path():
    temperature = torch.tensor([0.7, 0.7], dtype=torch.float64)
    assert not tc._filters_inactive(temperature, torch.tensor([0, 3]), torch.ones(2, dtype=torch.float64), 32)
    assert not tc._filters_inactive(temperature, torch.tensor([0, 0]), torch.tensor([1.0, 0.9], dtype=torch.float64), 32)
    # a greedy block's top-k / top-p never force the sort
    assert tc._filters_inactive(torch.tensor([0.0, 0.7], dtype=torch.float64), torch.tensor([3, 0]),
                                torch.tensor([0.9, 1.0], dtype=torch.float64), 32)


@needs_triton
def test_tail_chain_triton_matches_ref_on_an_unfiltered_batch(assert_close):
    """The sort-free path of the reference against the kernel (which never sorts)."""
    scores, cand, _, _, _, u = make_case(5, 15, 32, seed=3)
    temperature = torch.tensor([0.7, 0.0, 1.0, 0.5, 1.3], dtype=torch.float64)
    top_k, top_p = torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.float64)
    args = [a.to(DEV) for a in (scores, cand, temperature, top_k, top_p, u)]
    ref = tc.tail_chain_ref(*args)
    out = tc.tail_chain_triton(*args)
    assert torch.equal(out[1].cpu(), ref[1].cpu()), "choices differ"
    assert_close("q", ref[2], out[2], 1e-12)
