"""The DSpine tail (replica/tail.py): tables vs a slow recomputation, chain, sampling, retrieval switch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dspine.kernels.bridge import bridge_ref
from dspine.replica.tail import Proposal, TailTables, conditional_tables, draw_chain_uniforms, propose

NB, BS, H, D, M, V, K, R = 3, 6, 40, 24, 20, 97, 8, 24  # odd batch, H/D/M/V not powers of two
EPS = 1e-6


def make_params(seed=42, h=H, d=D, m=M, v=V):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cb = rn(v, d)
    return dict(codebook=cb / cb.norm(dim=1, keepdim=True), gate_recv=rn(m, d) / math.sqrt(d),
                gate_pred=rn(m, d) / math.sqrt(d), value_proj=rn(m, d) / math.sqrt(d), gate_bias=rn(m) * 0.1,
                read_proj=rn(d, h) / math.sqrt(h), write_proj=rn(h, m) / math.sqrt(m), head=rn(v, h) * 0.3,
                final_norm_weight=torch.rand(h, generator=g) + 0.5)


def make_draft_out(p, nb=NB, bs=BS, seed=42):
    """A DraftOut-like object built from the real bridge reference on random last-layer residuals."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(nb, bs, p["head"].shape[1], generator=g) * 3
    anchors = torch.randint(0, p["head"].shape[0], (nb,), generator=g)
    out = bridge_ref(x, anchors, p["codebook"], p["read_proj"], p["gate_recv"], p["gate_pred"], p["value_proj"],
                     p["gate_bias"], p["write_proj"], EPS)
    y = out.x_out
    hidden = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * p["final_norm_weight"]
    return SimpleNamespace(hidden=hidden, x_last=x, rms=out.rms, codes=out.codes), anchors


def build_tables(p, fp8=True, k=K, r=R):
    return TailTables.build(codebook=p["codebook"], gate_recv=p["gate_recv"], gate_pred=p["gate_pred"],
                            value_proj=p["value_proj"], gate_bias=p["gate_bias"], write_proj=p["write_proj"],
                            head=p["head"], final_norm_weight=p["final_norm_weight"], norm_eps=EPS,
                            head_topk=k, num_retrieve=r, retrieval="fp8" if fp8 else "exact")


def slow_score(p, out, n, t, pred_code, recv_id):
    """Really recompute the last bridge write of row t with a given predecessor code, then norm + head (f64)."""
    f = {k: v.double() for k, v in p.items()}
    c_t = out.codes[n, t].double()
    msg = torch.sigmoid(f["gate_recv"] @ c_t + f["gate_pred"] @ pred_code + f["gate_bias"]) * (f["value_proj"] @ pred_code)
    y = out.x_last[n, t].double() + out.rms[n, t].double() * (f["write_proj"] @ msg)
    h = y / torch.sqrt(y.pow(2).mean() + EPS) * f["final_norm_weight"]
    return float(f["head"][recv_id] @ h)


def test_slow_path_reproduces_draft_hidden_with_predicted_codes():
    """Sanity of the slow path itself: with the predicted predecessor code it gives DraftOut.hidden's logits."""
    p = make_params()
    out, _ = make_draft_out(p)
    for n, t, i in [(0, 1, 5), (2, BS - 1, 60)]:
        want = float(p["head"][i].double() @ out.hidden[n, t].double())
        got = slow_score(p, out, n, t, out.codes[n, t - 1].double(), i)
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want))


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_tables_equal_slow_recomputation_for_every_pair(table_dtype):
    p = make_params()
    out, anchors = make_draft_out(p)
    tables = TailTables.build(**{k: v for k, v in p.items() if k != "read_proj"}, norm_eps=EPS, head_topk=K,
                              num_retrieve=R, retrieval="exact", table_dtype=table_dtype)
    g = torch.Generator().manual_seed(7)
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(NB * (BS - 1))]).view(NB, BS - 1, K)
    scores = conditional_tables(out, tables, anchors, cand)
    assert scores.shape == (NB, BS - 1, K, K)
    slow = torch.empty(NB, BS - 1, K, K, dtype=torch.float64)
    for n in range(NB):
        for t in range(1, BS):
            for j in range(K):
                pred = int(anchors[n]) if t == 1 else int(cand[n, t - 2, j])
                code = math.sqrt(D) * p["codebook"][pred].double()
                for i in range(K):
                    slow[n, t - 1, j, i] = slow_score(p, out, n, t, code, int(cand[n, t - 1, i]))
    rel = ((scores.double() - slow).pow(2).mean().sqrt() / slow.pow(2).mean().sqrt()).item()
    assert rel < 1e-5, rel
    # row 1: every predecessor is the anchor, so all K table rows agree
    assert torch.allclose(scores[:, 0], scores[:, 0, :1].expand(-1, K, -1))


def brute_force(p, out, anchors, cand):
    """Greedy walk straight from the slow recomputation."""
    ids = torch.empty(NB, BS - 1, dtype=torch.int64)
    for n in range(NB):
        pred = int(anchors[n])
        for t in range(1, BS):
            code = math.sqrt(D) * p["codebook"][pred].double()
            sc = [slow_score(p, out, n, t, code, int(c)) for c in cand[n, t - 1]]
            best = max(range(K), key=lambda s: (sc[s], -s))
            pred = ids[n, t - 1] = int(cand[n, t - 1, best])
    return ids


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8-retrieval", "exact-retrieval"])
def test_greedy_propose_equals_brute_force_walk(fp8):
    p = make_params()
    out, anchors = make_draft_out(p)
    tables = build_tables(p, fp8=fp8)
    zeros = torch.zeros(NB)
    prop = propose(out, tables, anchors, zeros, torch.zeros(NB, dtype=torch.int64), torch.ones(NB))
    assert prop.draft_ids.shape == (NB, BS - 1) and prop.draft_ids.dtype == torch.int64
    assert prop.q.shape == prop.cand_ids.shape == (NB, BS - 1, K) and prop.q.dtype == torch.float64
    # candidates: the exact top-K of each proposal row (random data: inside the FP8 top-R)
    logits = out.hidden[:, 1:].double() @ p["head"].double().t()
    want = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :K]
    assert torch.equal(prop.cand_ids, want)
    assert torch.equal(prop.draft_ids, brute_force(p, out, anchors, prop.cand_ids))
    assert torch.equal(prop.q, torch.nn.functional.one_hot(prop.choice, K).double())
    assert torch.equal(prop.draft_ids, prop.cand_ids.gather(2, prop.choice[..., None])[..., 0])


def test_sampled_propose_q_and_reproducibility():
    p = make_params()
    out, anchors = make_draft_out(p)
    tables = build_tables(p)
    temperature = torch.tensor([0.0, 0.9, 1.5], dtype=torch.float64)  # greedy + sampled in one batch
    top_k = torch.tensor([0, 4, 0])
    top_p = torch.tensor([1.0, 1.0, 0.7], dtype=torch.float64)

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + b) for b in range(NB)]
        return propose(out, tables, anchors, temperature, top_k, top_p, gens)

    a, b, c = run(42), run(42), run(1000)
    assert torch.equal(a.draft_ids, b.draft_ids) and torch.equal(a.q, b.q)
    assert not torch.equal(a.draft_ids[1:], c.draft_ids[1:])  # different coins, different chains (whp)
    torch.testing.assert_close(a.q.sum(-1), torch.ones(NB, BS - 1, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (a.q.gather(2, a.choice[..., None]) > 0).all()  # every drawn token had positive q
    assert ((a.q[1] > 0).sum(-1) <= 4).all()  # top-k 4: zeros outside the kept set ...
    assert ((a.q[1] > 0).sum(-1) >= 1).all()
    assert ((a.q[2] > 0).sum(-1) < K).any()  # ... and top-p 0.7 drops some candidates
    assert ((a.q[0] == 0) | (a.q[0] == 1)).all()
    # dense q: zero outside the candidates, same mass
    dense = a.dense_q(V)
    assert dense.shape == (NB, BS - 1, V)
    torch.testing.assert_close(dense.sum(-1), a.q.sum(-1))
    assert torch.equal(dense.gather(2, a.cand_ids), a.q)


def test_greedy_requests_consume_no_coins():
    g0, g1 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    u = draw_chain_uniforms([g0, None], torch.tensor([0.0, 0.0]), 5, "cpu")
    assert torch.equal(u, torch.zeros(2, 5, dtype=torch.float64))
    assert torch.equal(torch.rand(2, generator=g0), torch.rand(2, generator=g1))
    with pytest.raises(ValueError, match="generators"):
        draw_chain_uniforms([g0], torch.tensor([1.0, 1.0]), 5, "cpu")


def test_tables_memory_and_switch():
    p = make_params()
    t = build_tables(p, fp8=False)
    nbytes = t.nbytes()
    assert nbytes["token_head_write"] == V * M * 4 and nbytes["token_gate_value"] == V * 2 * M * 4
    assert nbytes["head_fp8"] == 0
    out, anchors = make_draft_out(p)
    with pytest.raises(ValueError, match="retrieval: fp8 needs the FP8 head copy"):
        propose(out, t, anchors, torch.zeros(NB), torch.zeros(NB, dtype=torch.int64), torch.ones(NB),
                retrieval="fp8")
    assert Proposal.make_dummy(2, 4, 3).q.sum(-1).eq(1).all()


def test_bf16_retrieval_tables_and_switch():
    p = make_params()
    out, anchors = make_draft_out(p)
    args = dict(norm_eps=EPS, head_topk=K, num_retrieve=R)
    common = {k: p[k] for k in ("codebook", "gate_recv", "gate_pred", "value_proj", "gate_bias", "write_proj",
                                "head", "final_norm_weight")}
    t = TailTables.build(**common, **args, retrieval="bf16")
    assert t.nbytes()["head_bf16"] == V * H * 2 and t.head_bf16.dtype == torch.bfloat16
    hidden = out.hidden[:, 1:].reshape(-1, H)
    from dspine.replica.tail import retrieve_candidates

    from dspine.kernels import head_topk_bf16, head_topk_exact
    assert torch.equal(retrieve_candidates(hidden, t)[0], head_topk_bf16(hidden, t.head_bf16, K)[0])
    assert torch.equal(retrieve_candidates(hidden, t, "exact")[0], head_topk_exact(hidden, t.head, K)[0])
    with pytest.raises(ValueError, match="retrieval: fp8 needs"):
        retrieve_candidates(hidden, t, "fp8")
    with pytest.raises(ValueError, match="'fast' is not a valid RetrievalMode"):
        TailTables.build(**common, **args, retrieval="fast")


def test_from_drafter_builds_the_same_tables():
    dspine = pytest.importorskip("dspine.replica.models.dspine")
    from dspine.replica.models.dspine_config import DraftArgs

    args = DraftArgs.from_name("tiny-b4")
    head = torch.randn(args.vocab_size, args.hidden_size)
    drafter = dspine.DSpineDrafter(args, embed_tokens=None, lm_head_weight=head)
    drafter.init_weights(torch.Generator().manual_seed(42))
    t = TailTables.from_drafter(drafter, retrieval="exact")
    br = drafter.bridge
    want = (head * drafter.norm.weight.detach()) @ br.write_proj[-1].detach()
    torch.testing.assert_close(t.token_head_write, want)
    assert t.head_topk == args.head_topk and t.num_retrieve == args.num_retrieve


def test_confidence_never_reads_the_token_drawn_at_its_own_row():
    """Row t's confidence is the top probability of its table at the chosen y_{t-1}: changing the
    choice at row t changes the confidence of row t + 1 only (sampled verification stays lossless)."""
    from dspine.replica.tail import chain_confidence

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 5, K, K, generator=g)
    scores[:, 0] = scores[:, 0, :1]  # row 1: every predecessor is the anchor
    choice = torch.randint(0, K, (2, 5), generator=g)
    conf = chain_confidence(scores, choice)
    pred = torch.cat([torch.zeros_like(choice[:, :1]), choice[:, :-1]], dim=1)
    for n in range(2):
        for t in range(5):
            want = scores[n, t, pred[n, t]].softmax(-1).max()
            assert torch.isclose(conf[n, t], want)
    other = choice.clone()
    other[:, 2] = (other[:, 2] + 1) % K
    changed = chain_confidence(scores, other) != conf
    assert not changed[:, :3].any() and changed[:, 3].all()


def test_verify_lengths_follow_the_confidence_product():
    from dspine.replica.tail import verify_lengths

    conf = torch.tensor([[0.9, 0.9, 0.5, 0.9], [0.3, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0]])
    # products: [0.9, 0.81, 0.405, 0.3645], [0.3, 0.27, 0.243, 0.2187], [1, 1, 1, 1]
    assert verify_lengths(conf, 0.4).tolist() == [3, 0, 4]
    assert verify_lengths(conf, 0.25).tolist() == [4, 2, 4]
    assert verify_lengths(conf, 0.0).tolist() == [4, 4, 4]


def test_propose_fills_confidence():
    p = make_params()
    out, anchors = make_draft_out(p)
    prop = propose(out, build_tables(p), anchors, torch.zeros(NB), torch.zeros(NB, dtype=torch.int64), torch.ones(NB))
    assert prop.confidence.shape == (NB, BS - 1)
    assert ((prop.confidence >= 1.0 / K - 1e-6) & (prop.confidence <= 1.0)).all()


def test_propose_without_confidence_drafts_the_same_block():
    p = make_params()
    out, anchors = make_draft_out(p)
    tables = build_tables(p)
    temperature, top_k, top_p = torch.full((NB,), 0.8), torch.zeros(NB, dtype=torch.int64), torch.ones(NB)
    uniforms = torch.rand(NB, BS - 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    full = propose(out, tables, anchors, temperature, top_k, top_p, uniforms=uniforms)
    lean = propose(out, tables, anchors, temperature, top_k, top_p, uniforms=uniforms, with_confidence=False)
    assert lean.confidence is None and full.confidence is not None
    assert torch.equal(lean.draft_ids, full.draft_ids) and torch.equal(lean.q, full.q)
