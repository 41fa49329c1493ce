"""fp8_head_topk: e4m3 emulation, Triton kernels (interpreter on CPU) vs reference, and the approximation."""

from __future__ import annotations

import importlib

import pytest
import torch

fh = importlib.import_module("dspine.kernels.fp8_head_topk")


@pytest.fixture
def triton_ready(kernel_module):
    """Fails (never skips) when the Triton kernels cannot run here (CPU without TRITON_INTERPRET=1)."""
    kernel_module("fp8_head_topk")


needs_triton = pytest.mark.usefixtures("triton_ready")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch lacks float8_e4m3fn")
def test_round_to_e4m3_equals_torch_cast():
    torch.manual_seed(42)
    x = torch.cat([torch.randn(5000) * 100, torch.randn(2000) * 1e-2, torch.rand(100) * 2e-3,  # subnormals
                   torch.tensor([0.0, -0.0, 448.0, -448.0, 2 ** -9, 2 ** -10, 3 * 2 ** -11, 240.0, 232.0])])
    x = x.clamp(-448, 448)
    assert torch.equal(fh.round_to_e4m3(x), x.to(torch.float8_e4m3fn).float())


def test_quantize_head_fp8_emulated_equals_native():
    torch.manual_seed(42)
    head = torch.randn(37, 19) * torch.rand(37, 1) * 5
    q, s = fh.quantize_head_fp8(head, emulate=True)
    assert q.dtype == torch.float32 and s.shape == (37,)
    assert (q.abs().amax(1) == 448).all()
    rel = ((q * s[:, None] - head).norm() / head.norm()).item()
    assert rel < 0.05  # 3 mantissa bits
    if hasattr(torch, "float8_e4m3fn"):
        qn, sn = fh.quantize_head_fp8(head)
        assert qn.dtype == torch.float8_e4m3fn
        assert torch.equal(qn.float(), q) and torch.equal(sn, s)


SHAPES = [  # n, v, h, r, k, tile_v
    pytest.param(1, 300, 40, 32, 5, 64, id="n1-v300-h40-r32-k5-tile64"),
    pytest.param(3, 257, 24, 16, 16, 32, id="n3-v257-h24-r16-k16-tile32"),
    pytest.param(2, 20, 33, 128, 16, 32, id="n2-v20-h33-r128>v-k16"),
]


@needs_triton
@pytest.mark.parametrize("emulate", [False, True], ids=["fp8", "fp32-emulated"])
@pytest.mark.parametrize("n,v,h,r,k,tile_v", SHAPES)
def test_fp8_head_topk_triton_matches_ref(n, v, h, r, k, tile_v, emulate, assert_close):
    if not emulate and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch lacks float8_e4m3fn")
    torch.manual_seed(42)
    head = torch.randn(v, h, device=DEV)
    hidden = torch.randn(n, h, device=DEV)
    head_fp8, scale = fh.quantize_head_fp8(head, emulate=emulate)
    ids_ref, lg_ref = fh.fp8_head_topk_ref(hidden, head_fp8, scale, head, r, k)
    ids, lg = fh.fp8_head_topk_triton(hidden, head_fp8, scale, head, r, k, tile_v=tile_v, block_v=32, block_h=16)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert_close("cand_logits", lg_ref, lg, 1e-6)
    assert ids.dtype == torch.int64 and lg.dtype == torch.float32
    assert (lg[:, :-1] >= lg[:, 1:]).all()  # sorted descending


def test_exact_topk_whenever_retrieved():
    """Rescoring returns the exact fp32 top-k for every row whose exact top-k lies inside the R retrieved."""
    torch.manual_seed(42)
    n, v, h, r, k = 64, 500, 32, 24, 8
    head = torch.randn(v, h)
    hidden = torch.randn(n, h)
    head_fp8, scale = fh.quantize_head_fp8(head)
    ids, lg = fh.fp8_head_topk_ref(hidden, head_fp8, scale, head, r, k)
    ex_ids, ex_lg = fh.head_topk_exact(hidden, head, k)
    approx = (hidden @ head_fp8.float().t()) * scale
    retrieved = torch.sort(approx, dim=1, descending=True, stable=True).indices[:, :r]
    inside = torch.stack([torch.isin(ex_ids[i], retrieved[i]).all() for i in range(n)])
    assert inside.sum() >= n // 2  # the condition is the common case
    assert torch.equal(ids[inside], ex_ids[inside])
    torch.testing.assert_close(lg[inside], ex_lg[inside], rtol=1e-6, atol=1e-5)  # same ids, fp32 rounding


def test_exact_topk_ties_to_lower_id():
    head = torch.zeros(10, 4)
    head[[2, 5, 7], 0] = 1.0  # three tied best tokens
    hidden = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    ids, _ = fh.head_topk_exact(hidden, head, 2)
    assert ids.tolist() == [[2, 5]]
    q, s = fh.quantize_head_fp8(head)
    ids, _ = fh.fp8_head_topk_ref(hidden, q, s, head, 4, 2)
    assert ids.tolist() == [[2, 5]]


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_fp8_retrieval_can_miss_the_exact_top1(impl, request):
    if impl == "triton":
        request.getfixturevalue("triton_ready")
    """Documented approximation: a head row with one huge outlier coordinate gets a row scale that
    rounds its useful coordinates to zero in e4m3. Its true logit is the largest, but its FP8 score
    is 0, outside the R retrieved, so the fast path cannot return it; the exact fallback does."""
    torch.manual_seed(42)
    v, h, r, k = 200, 32, 8, 4
    hidden = torch.randn(1, h)
    hidden[0, 0] = 0.0  # the outlier coordinate does not contribute to the true logit
    head = torch.randn(v, h) * 0.05
    star = 123
    head[star] = torch.sign(hidden[0])  # true logit = sum |hidden| ~ 25, far above the rest
    head[star, 0] = 1e6  # outlier: scale 1e6 / 448, every other entry rounds to 0
    head_fp8, scale = fh.quantize_head_fp8(head)
    assert (head_fp8[star, 1:].float() == 0).all()
    ex_ids, _ = fh.head_topk_exact(hidden, head, k)
    assert int(ex_ids[0, 0]) == star
    if impl == "ref":
        ids, _ = fh.fp8_head_topk_ref(hidden, head_fp8, scale, head, r, k)
    else:
        ids, _ = fh.fp8_head_topk_triton(hidden.to(DEV), head_fp8.to(DEV), scale.to(DEV), head.to(DEV), r, k,
                                         tile_v=64, block_v=64, block_h=32)
    assert star not in ids[0].tolist()  # the exact top-1 is missed by the fast path
    assert torch.equal(ids[0].cpu(), fh.head_topk_exact(hidden, head, k + 1)[0][0, 1:])  # the rest is exact


def test_rejects_k_above_retrieval():
    head = torch.randn(10, 4)
    q, s = fh.quantize_head_fp8(head)
    with pytest.raises(ValueError, match="k"):
        fh.fp8_head_topk_ref(torch.randn(1, 4), q, s, head, 4, 5)


def test_bf16_scan_equals_exact_top_k_on_bf16_representable_inputs():
    """Small-integer hidden and head give integer logits of at most 128 in magnitude, exact in
    bf16: the scan then returns the exact top-k scores; its ids carry exactly those scores and,
    away from ties at the k-th place, form the same set."""
    g = torch.Generator().manual_seed(0)
    head = torch.randint(-4, 5, (300, 16), generator=g).float()
    hidden = torch.randint(-2, 3, (7, 16), generator=g).float()
    ids_exact, logits_exact = fh.head_topk_exact(hidden, head, 10)
    ids, logits = fh.head_topk_bf16(hidden, head.to(torch.bfloat16), 10)
    assert ids.dtype == torch.int64 and logits.dtype == torch.float32
    assert torch.equal(logits, logits_exact)
    assert torch.equal((hidden[:, None, :] * head[ids]).sum(-1), logits)  # each id carries its score
    all_logits = hidden @ head.t()
    for row in range(7):
        boundary = logits_exact[row, -1]
        if (all_logits[row] == boundary).sum() == (logits_exact[row] == boundary).sum():  # no tie across k
            assert set(ids[row].tolist()) == set(ids_exact[row].tolist())


def test_bf16_scan_is_close_to_exact_on_random_heads():
    g = torch.Generator().manual_seed(1)
    head, hidden = torch.randn(2000, 64, generator=g) * 0.05, torch.randn(15, 64, generator=g)
    ids_exact, _ = fh.head_topk_exact(hidden, head, 16)
    ids, _ = fh.head_topk_bf16(hidden, head.to(torch.bfloat16), 16)
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, ids_exact)) / ids.numel()
    assert 0.9 < overlap <= 1.0
