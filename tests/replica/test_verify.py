"""Verification: hand-built cases (vLLM style), exactness of sparse vs dense q,
seeded determinism, and statistical proof that committed tokens follow p."""

import math

from dspine_testing.stats import chi2_sf

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspine import faults
from dspine.replica.sampling import draw_uniforms, make_generator, probabilities, sample
from dspine.replica.verify import PLACEHOLDER_TOKEN_ID, VerifyResult, verify_greedy, verify_sampled

F64 = torch.float64
P = PLACEHOLDER_TOKEN_ID


def one_hot_logits(ids, vocab=8):
    """[B, T] target argmax ids -> [B, T, V] logits whose argmax is that id."""
    ids = torch.as_tensor(ids)
    logits = torch.zeros(*ids.shape, vocab)
    logits.scatter_(-1, ids[..., None], 10.0)
    return logits


def check(res: VerifyResult, output, accepted):
    assert res.output_ids.dtype == torch.int32
    assert res.output_ids.tolist() == output
    assert res.accepted_len.tolist() == accepted
    assert res.num_emitted.tolist() == [a + 1 for a in accepted]


# --------------------------------------------------------------------------- greedy, hand-built


def test_perfect_match():
    res = verify_greedy(torch.tensor([[1, 2, 3]]), one_hot_logits([[1, 2, 3, 4]]))
    check(res, [[1, 2, 3, 4]], [3])
    assert res.is_bonus.tolist() == [True]


def test_early_mismatch():
    res = verify_greedy(torch.tensor([[1, 5, 3]]), one_hot_logits([[1, 2, 3, 4]]))
    check(res, [[1, 2, P, P]], [1])
    assert res.is_bonus.tolist() == [False]


def test_first_token_mismatch():
    check(verify_greedy(torch.tensor([[7, 2, 3]]), one_hot_logits([[1, 2, 3, 4]])), [[1, P, P, P]], [0])


def test_empty_block_k0():
    check(verify_greedy(torch.zeros(2, 0, dtype=torch.int64), one_hot_logits([[6], [2]])), [[6], [2]], [0, 0])


def test_batch_of_outcomes_and_padding():
    draft = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 0, 0], [4, 4, 4]])
    target = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 0, 0, 0], [4, 4, 5, 6]])
    check(
        verify_greedy(draft, target),
        [[1, 2, 3, 4], [1, 2, P, P], [1, P, P, P], [4, 4, 5, P]],
        [3, 1, 0, 2],
    )


def test_greedy_ties_to_lower_id():
    logits = torch.tensor([[[0.0, 3.0, 3.0], [1.0, 1.0, 1.0]]])
    check(verify_greedy(torch.tensor([[2]]), logits), [[1, P]], [0])
    check(verify_greedy(torch.tensor([[1]]), logits), [[1, 0]], [1])


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^target_logits:"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match=r"^uniforms_accept:"):
        verify_sampled(
            torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, 4, dtype=F64), torch.zeros(1, 3, 4, dtype=F64),
            torch.zeros(1, 3, dtype=F64), torch.zeros(1, dtype=F64),
        )
    assert VerifyResult.make_empty(15).output_ids.shape == (0, 16)


# --------------------------------------------------------------------------- sampled, hand-built


def test_sampled_hand_built_accept_reject_and_residual():
    # V = 3. Row 0: p(y=0) = 0.5, q(y=0) = 1.0 -> accept iff u < 0.5.
    # Residual [p - q]+ = [0, 0.2, 0.3] / 0.5.
    p = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.6, 0.3]], dtype=F64)
    q = torch.tensor([[1.0, 0.0, 0.0]], dtype=F64)
    probs = p[None].expand(4, 2, 3)
    draft = torch.zeros(4, 1, dtype=torch.int64)
    u_acc = torch.tensor([[0.3], [0.7], [0.4999], [0.5]], dtype=F64)
    u_res = torch.tensor([0.05, 0.3, 0.95, 0.5], dtype=F64)
    res = verify_sampled(draft, q[None].expand(4, 1, 3), probs, u_acc, u_res)
    # accepted rows draw the bonus from p[1] = [0.1, 0.6, 0.3]: u 0.05 -> 0, 0.95 -> 2
    # rejected rows draw from [0, 0.4, 0.6]: u 0.3 -> 1, 0.5 -> 2
    check(res, [[0, 0], [1, P], [0, 2], [2, P]], [1, 0, 1, 0])


def test_sampled_p_equals_q_accepts_everything():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(16, 4, 9, generator=g, dtype=F64), -1)
    draft = sample(p[:, :3].reshape(-1, 9), torch.rand(48, generator=g, dtype=F64)).view(16, 3)
    u_acc = torch.rand(16, 3, generator=g, dtype=F64)
    u_acc[0] = 1 - 2**-53  # the largest coin still accepts
    res = verify_sampled(draft, p[:, :3], p, u_acc, torch.rand(16, generator=g, dtype=F64))
    assert res.accepted_len.tolist() == [3] * 16


def test_zero_q_accepts_iff_p_positive():
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]]], dtype=F64)
    q = torch.tensor([[[0.0, 0.0, 1.0]]], dtype=F64)
    u0 = torch.zeros(1, 1, dtype=F64)
    assert verify_sampled(torch.tensor([[1]]), q, p, u0, torch.zeros(1, dtype=F64)).accepted_len.tolist() == [1]
    assert verify_sampled(torch.tensor([[0]]), q, p, u0, torch.zeros(1, dtype=F64)).accepted_len.tolist() == [0]


def test_degenerate_residual_draws_from_p():
    # q(1) exceeds p(1) by one ulp; the largest coin rejects (u * q rounds to p),
    # and [p - q]+ is exactly zero: the recovered token comes from p itself.
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]], dtype=F64)
    q = torch.tensor([[[0.5, 0.5 + 2**-53]]], dtype=F64)
    assert float((p[0, 0] - q[0, 0]).clamp(min=0).sum()) == 0.0
    u_acc = torch.tensor([[1 - 2**-53]], dtype=F64)
    for u, want in [(0.25, 0), (0.75, 1)]:
        res = verify_sampled(torch.tensor([[1]]), q, p, u_acc, torch.tensor([u], dtype=F64))
        check(res, [[want, P]], [0])


def test_sampled_k0_is_a_draw_from_p():
    p = torch.tensor([[[0.25, 0.25, 0.5]]] * 3, dtype=F64)
    res = verify_sampled(
        torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, 0, 4, dtype=F64), p,
        torch.zeros(3, 0, dtype=F64), torch.tensor([0.1, 0.3, 0.9], dtype=F64),
        draft_q_ids=torch.zeros(3, 0, 4, dtype=torch.int64),
    )
    check(res, [[0], [1], [2]], [0, 0, 0])


def test_mixed_batch_greedy_and_sampled_rows():
    v = 6
    logits = torch.tensor(
        [[[0, 5, 1, 0, 0, 0], [0, 0, 0, 4, 0, 0], [2, 0, 0, 0, 0, 0]]] * 3, dtype=F64
    )  # argmax 1, 3, 0
    temperature = torch.tensor([0.0, 1.0, 0.0]).repeat_interleave(3)
    probs = probabilities(logits.reshape(-1, v), temperature, 0, 1.0).view(3, 3, v)
    draft = torch.tensor([[1, 3], [1, 3], [1, 2]])
    q = torch.full((3, 2, 2), 0.5, dtype=F64)  # sparse q over candidates {draft, draft + 1}
    q_ids = torch.stack([draft, draft + 1], dim=-1)
    u_acc = torch.tensor([[0.9, 0.9], [0.0, 0.0], [0.0, 0.0]], dtype=F64)
    u_res = torch.tensor([0.99, 0.0, 0.99], dtype=F64)
    greedy = torch.tensor([True, False, True])
    res = verify_sampled(draft, q, probs, u_acc, u_res, draft_q_ids=q_ids, greedy=greedy)
    # row 0 greedy: both match the argmax -> bonus argmax 0, coins ignored
    # row 1 sampled: p(y) > 0 and coin 0 -> accepted; bonus from p[2] with u = 0 -> its first positive id
    # row 2 greedy: 2 != argmax 3 -> recovered 3
    bonus1 = int(sample(probs[1, 2][None], torch.zeros(1, dtype=F64)))
    check(res, [[1, 3, 0], [1, 3, bonus1], [1, 3, P]], [2, 2, 1])
    # greedy rows agree with verify_greedy on the raw logits
    ref = verify_greedy(draft[[0, 2]], logits[[0, 2]])
    assert torch.equal(res.output_ids[[0, 2]], ref.output_ids)


# --------------------------------------------------------------------------- sparse == dense, determinism


def _random_case(seed, b, k, v, c):
    """Random p (with filtering zeros), sparse q over distinct candidates, drafts drawn from q, coins."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b * (k + 1), v, generator=g, dtype=F64) * 2
    temperature = torch.rand(b * (k + 1), generator=g, dtype=F64) + 0.3
    top_k = torch.randint(0, v + 1, (b * (k + 1),), generator=g)
    top_p = torch.rand(b * (k + 1), generator=g, dtype=F64) * 0.6 + 0.4
    p = probabilities(logits, temperature, top_k, top_p).view(b, k + 1, v)
    q_ids = torch.argsort(torch.rand(b, k, v, generator=g), dim=-1)[..., :c]
    q = probabilities(torch.randn(b * k, c, generator=g, dtype=F64), 1.0, 0, 1.0).view(b, k, c)
    # a few positions with q == p restricted to the candidates (near-degenerate residuals)
    same = torch.rand(b, k, generator=g) < 0.2
    p_on_c = p[:, :k].gather(2, q_ids)
    q = torch.where(same[..., None] & (p_on_c.sum(-1, keepdim=True) > 0), p_on_c / p_on_c.sum(-1, keepdim=True), q)
    slot = sample(q.reshape(-1, c), torch.rand(b * k, generator=g, dtype=F64)).view(b, k)
    draft = q_ids.gather(2, slot[..., None]).squeeze(-1)
    u_acc = torch.rand(b, k, generator=g, dtype=F64)
    u_acc[torch.rand(b, k, generator=g) < 0.1] = 1 - 2**-53
    u_res = torch.rand(b, generator=g, dtype=F64)
    greedy = torch.rand(b, generator=g) < 0.25
    return draft, q, q_ids, p, u_acc, u_res, greedy


def _dense(q, q_ids, v):
    return torch.zeros(*q.shape[:2], v, dtype=q.dtype).scatter_(2, q_ids, q)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 9),
    k=st.integers(0, 6),
    v=st.integers(2, 40),
    data=st.data(),
)
def test_sparse_and_dense_q_identical(seed, b, k, v, data):
    c = data.draw(st.integers(1, v))
    draft, q, q_ids, p, u_acc, u_res, greedy = _random_case(seed, b, k, v, c)
    for mask in (None, greedy):
        sparse = verify_sampled(draft, q, p, u_acc, u_res, draft_q_ids=q_ids, greedy=mask)
        dense = verify_sampled(draft, _dense(q, q_ids, v), p, u_acc, u_res, greedy=mask)
        assert torch.equal(sparse.output_ids, dense.output_ids)
        assert torch.equal(sparse.accepted_len, dense.accepted_len)
        # every emitted token is in the support of its target distribution
        pos = torch.arange(k + 1)[None, :].expand(b, -1)
        emitted = pos < sparse.num_emitted[:, None]
        ids = sparse.output_ids.long().clamp(min=0)
        assert (p.gather(2, ids[..., None]).squeeze(-1)[emitted] > 0).all()
        assert (sparse.output_ids[~emitted] == P).all()


def test_seeded_determinism():
    draft, q, q_ids, p, _, _, _ = _random_case(11, 4, 15, 50, 16)

    def run(seeds):
        gens = [make_generator(s) for s in seeds]
        coins = draw_uniforms(gens, 16)  # fixed count per request per step
        return verify_sampled(draft, q, p, coins[:, :15], coins[:, 15], draft_q_ids=q_ids)

    a, b = run([1, 2, 3, 4]), run([1, 2, 3, 4])
    assert torch.equal(a.output_ids, b.output_ids)
    # request 1's outcome does not depend on its neighbours' seeds
    c = run([9, 2, 8, 7])
    assert torch.equal(a.output_ids[1], c.output_ids[1])


# --------------------------------------------------------------------------- statistics


def test_chi2_sf_against_closed_forms():
    for x in (0.1, 1.0, 3.0, 10.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-9)


def chi2_pvalue(ids, expected_probs):
    """Goodness of fit of outcome ids to a distribution; a zero-probability outcome gives p-value 0."""
    counts = torch.bincount(ids.flatten().long(), minlength=expected_probs.numel()).double()
    support = expected_probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    n = counts.sum()
    exp = n * expected_probs[support]
    assert exp.min() >= 5, "too few samples per cell for the chi-square approximation"
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    return chi2_sf(stat, int(support.sum()) - 1)


V = 8
LOGITS_1 = torch.tensor([[2.0, 1.5, 1.2, 0.3, 0.0, -0.5, 1.0, -2.0]], dtype=F64)
CAND_1 = torch.tensor([0, 2, 3, 7])  # includes tokens p filters out, misses tokens p likes


def target_p1():
    return probabilities(LOGITS_1, [0.8], [6], [0.9])[0]


def draft_q1():
    return probabilities(torch.tensor([[0.5, 1.0, 0.2, 0.8]], dtype=F64), [1.3], [0], [1.0])[0]


def first_token_round(n, seed):
    """One K = 1 round for n rows sharing p and the sparse q; returns the committed first tokens."""
    g = torch.Generator().manual_seed(seed)
    p1, q1 = target_p1(), draft_q1()
    y = CAND_1[sample(q1.expand(n, -1), torch.rand(n, generator=g, dtype=F64))][:, None]  # [n, 1]
    probs = torch.stack([p1, p1]).expand(n, 2, V)
    u_acc = torch.rand(n, 1, generator=g, dtype=F64)
    u_res = torch.rand(n, generator=g, dtype=F64)
    res = verify_sampled(
        y, q1.expand(n, 1, -1), probs, u_acc, u_res, draft_q_ids=CAND_1.expand(n, 1, -1)
    )
    return res.output_ids[:, 0]


def test_target_and_proposal_are_nontrivial():
    p1, q1 = target_p1(), draft_q1()
    assert int((p1 > 0).sum()) == 4  # top-k drops tokens 5 and 7, top-p drops 3 and 4
    support = torch.zeros(V, dtype=torch.bool)
    support[CAND_1] = True
    assert (p1[~support] > 0.1).any() and (p1[CAND_1] == 0).any() and (q1 > 0).all()


def test_first_token_follows_target_distribution():
    assert chi2_pvalue(first_token_round(200_000, seed=0), target_p1()) > 1e-3


@pytest.mark.parametrize("fault", ["verify.always_accept", "verify.recover_from_p"])
def test_broken_verifier_fails_the_same_test(fault):
    """verify_sampled itself, with the bug injected at its fault point (dspine.faults)."""
    with faults.inject(fault):
        tokens = first_token_round(200_000, seed=0)
    assert chi2_pvalue(tokens, target_p1()) < 1e-12


def test_distribution_converges_as_n_grows():
    p1 = target_p1()
    tvs = []
    for n in (1_000, 10_000, 100_000):
        ids = first_token_round(n, seed=n)
        freq = torch.bincount(ids.long(), minlength=V).double() / n
        tvs.append(0.5 * float((freq - p1).abs().sum()))
    assert tvs[0] > tvs[1] > tvs[2] and tvs[2] < 0.01, tvs


V2, C2 = 6, 3


def chain_tables():
    """Target p1, p2(. | x1) and a draft chain q1, q2(. | y1), sparse over C2 candidates."""
    g = torch.Generator().manual_seed(5)
    p1 = probabilities(torch.randn(1, V2, generator=g, dtype=F64), [1.2], [5], [0.95])[0]
    logits2 = torch.randn(V2, V2, generator=g, dtype=F64) * 1.5
    p2 = probabilities(logits2, torch.full((V2,), 0.9), torch.full((V2,), 4), torch.full((V2,), 0.9))
    cand1 = torch.tensor([1, 2, 4])
    q1 = probabilities(torch.randn(1, C2, generator=g, dtype=F64), [1.0], [0], [1.0])[0]
    cand2 = torch.argsort(torch.rand(V2, V2, generator=g), dim=-1)[:, :C2]  # per predecessor
    q2 = probabilities(torch.randn(V2, C2, generator=g, dtype=F64), torch.full((V2,), 0.7), 0, 1.0)
    return p1, p2, cand1, q1, cand2, q2


def two_tokens(n, seed, broken=False):
    """Committed (x1, x2): a K = 2 round, then for rows that emitted only x1, a K = 1 round after x1."""
    p1, p2, cand1, q1, cand2, q2 = chain_tables()
    g = torch.Generator().manual_seed(seed)
    y1 = cand1[sample(q1.expand(n, -1), torch.rand(n, generator=g, dtype=F64))]
    y2 = cand2[y1].gather(1, sample(q2[y1], torch.rand(n, generator=g, dtype=F64))[:, None]).squeeze(1)
    draft = torch.stack([y1, y2], dim=1)
    probs = torch.stack([p1.expand(n, -1), p2[y1], p1.expand(n, -1)], dim=1)  # row 2: any p3
    q = torch.stack([q1.expand(n, -1), q2[y1]], dim=1)
    q_ids = torch.stack([cand1.expand(n, -1), cand2[y1]], dim=1)
    u_acc, u_res = torch.rand(n, 2, generator=g, dtype=F64), torch.rand(n, generator=g, dtype=F64)
    if broken:
        u_acc = torch.zeros_like(u_acc)  # "accept whenever p > 0": ignores q
    res = verify_sampled(draft, q, probs, u_acc, u_res, draft_q_ids=q_ids)
    x1 = res.output_ids[:, 0].long()
    x2 = res.output_ids[:, 1].long()

    # next round for rows whose first round emitted one token: draft after x1
    z = cand2[x1].gather(1, sample(q2[x1], torch.rand(n, generator=g, dtype=F64))[:, None])
    probs2 = torch.stack([p2[x1], p1.expand(n, -1)], dim=1)
    u_acc2, u_res2 = torch.rand(n, 1, generator=g, dtype=F64), torch.rand(n, generator=g, dtype=F64)
    if broken:
        u_acc2 = torch.zeros_like(u_acc2)
    nxt = verify_sampled(z, q2[x1][:, None], probs2, u_acc2, u_res2, draft_q_ids=cand2[x1][:, None])
    x2 = torch.where(res.accepted_len >= 1, x2, nxt.output_ids[:, 0].long())
    return x1 * V2 + x2


def test_two_committed_tokens_follow_target_joint():
    p1, p2, *_ = chain_tables()
    joint = (p1[:, None] * p2).flatten()
    assert chi2_pvalue(two_tokens(200_000, seed=1), joint) > 1e-3
    assert chi2_pvalue(two_tokens(200_000, seed=1, broken=True), joint) < 1e-12


# ---------------------------------------------------------------- dynamic verification (num_verified)
def test_greedy_num_verified_stops_at_each_requests_length():
    draft = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    target = one_hot_logits([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 7, 3, 4, 5]])
    res = verify_greedy(draft, target, num_verified=torch.tensor([2, 0, 3]))
    # request 0 verifies y1, y2 (both right): bonus = target argmax at row 2 (3), not y3
    # request 1 verifies nothing: the target's own token at row 0
    # request 2 verifies y1..y3 and is rejected at y2
    check(res, [[1, 2, 3, P, P], [1, P, P, P, P], [1, 7, P, P, P]], [2, 0, 1])
    assert res.is_bonus.tolist() == [True, True, False]


@pytest.mark.parametrize("greedy_rows", [False, True])
def test_sampled_num_verified_equals_verifying_the_truncated_draft(greedy_rows):
    """With the same p, q and coins, verifying K_b of K tokens gives exactly what verifying a
    K_b-token draft gives (the rows past K_b are never read)."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 6, 5, 11
    p = torch.rand(b, k + 1, v, generator=g, dtype=F64).softmax(-1)
    q = torch.rand(b, k, v, generator=g, dtype=F64).pow(4)
    q = q / q.sum(-1, keepdim=True)
    draft = torch.multinomial(q.view(-1, v), 1, generator=g).view(b, k)
    u = torch.rand(b, k, generator=g, dtype=F64)
    u_final = torch.rand(b, generator=g, dtype=F64)
    lengths = torch.tensor([0, 1, 2, 3, 5, 4])
    greedy = torch.tensor([greedy_rows, False, greedy_rows, False, greedy_rows, False])
    res = verify_sampled(draft, q, p, u, u_final, greedy=greedy, num_verified=lengths)
    for i, n in enumerate(lengths.tolist()):
        alone = verify_sampled(draft[i : i + 1, :n], q[i : i + 1, :n], p[i : i + 1, : n + 1], u[i : i + 1, :n],
                               u_final[i : i + 1], greedy=greedy[i : i + 1])
        assert res.accepted_len[i] == alone.accepted_len[0]
        assert res.output_ids[i, : n + 1].tolist() == alone.output_ids[0].tolist()
    assert (res.accepted_len <= lengths).all()


def test_num_verified_is_validated():
    draft = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="num_verified"):
        verify_greedy(draft, one_hot_logits([[1, 2, 3]]), num_verified=torch.tensor([3]))
    with pytest.raises(ValueError, match="num_verified"):
        verify_greedy(draft, one_hot_logits([[1, 2, 3]]), num_verified=torch.tensor([1, 1]))
