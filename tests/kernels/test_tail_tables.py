"""tail_tables: Triton kernel (interpreter on CPU) vs the torch reference, and the precomputed tables."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

tt = importlib.import_module("dspine.kernels.tail_tables")


@pytest.fixture
def triton_ready(kernel_module):
    """Fails (never skips) when the Triton kernels cannot run here (CPU without TRITON_INTERPRET=1)."""
    kernel_module("tail_tables")


needs_triton = pytest.mark.usefixtures("triton_ready")


def make_case(nb, bs, h, d, m, k, v, dtype=torch.float32, device="cpu"):
    torch.manual_seed(42)
    x = torch.randn(nb, bs, h)
    p = dict(
        codebook=torch.randn(v, d) / math.sqrt(d), gate_recv=torch.randn(m, d) / math.sqrt(d),
        gate_pred=torch.randn(m, d) / math.sqrt(d), value_proj=torch.randn(m, d) / math.sqrt(d),
        gate_bias=torch.randn(m) * 0.1, write_proj=torch.randn(h, m) / math.sqrt(m), head=torch.randn(v, h),
        final_norm_weight=torch.rand(h) + 0.5,
    )
    rms = x.pow(2).mean(-1).sqrt()
    codes = torch.randn(nb, bs, d)
    cand = torch.stack([torch.randperm(v)[:k] for _ in range(nb * (bs - 1))]).view(nb, bs - 1, k)
    pred = torch.randint(0, v, (nb, bs - 1, k))
    thw, tgv, gram = tt.precompute_tail_tables(p["codebook"], p["gate_pred"], p["value_proj"], p["write_proj"],
                                               p["head"], p["final_norm_weight"], dtype=dtype)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    args = (cast(x), cast(rms), cast(codes), cand.to(device), pred.to(device), cast(p["gate_recv"]),
            cast(p["gate_bias"]), tgv.to(device), thw.to(device), gram.to(device), cast(p["write_proj"]),
            cast(p["head"]), cast(p["final_norm_weight"]), 1e-6)
    return args, p


SHAPES = [  # nb, bs, h, d, m, k, v
    pytest.param(1, 2, 20, 12, 10, 4, 50, id="nb1-bs2-h20-d12-m10-k4"),
    pytest.param(3, 5, 60, 24, 20, 16, 301, id="nb3-bs5-h60-d24-m20-k16-v301"),
    pytest.param(2, 4, 100, 36, 72, 5, 97, id="nb2-bs4-h100-d36-m72-k5"),
]


@needs_triton
@pytest.mark.parametrize("nb,bs,h,d,m,k,v", SHAPES)
def test_tail_tables_triton_matches_ref(nb, bs, h, d, m, k, v, assert_close):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args, _ = make_case(nb, bs, h, d, m, k, v, device=dev)
    ref = tt.tail_tables_ref(*args)
    out = tt.tail_tables_triton(*args)
    assert out.shape == (nb, bs - 1, k, k)
    assert_close("scores", ref, out, 1e-5)


@needs_triton
def test_tail_tables_triton_bf16_tables(assert_close):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args, _ = make_case(2, 3, 40, 16, 24, 8, 77, dtype=torch.bfloat16, device=dev)
    assert_close("scores", tt.tail_tables_ref(*args), tt.tail_tables_triton(*args), 1e-4)


def test_precompute_tail_tables_definition(assert_close):
    torch.manual_seed(42)
    v, d, m, h = 37, 12, 10, 20
    cb, gp, a = torch.randn(v, d), torch.randn(m, d), torch.randn(m, d)
    w, head, g = torch.randn(h, m), torch.randn(v, h), torch.rand(h)
    thw, tgv, gram = tt.precompute_tail_tables(cb, gp, a, w, head, g, chunk=5)
    c = math.sqrt(d) * cb.double()
    assert_close("thw", (head.double() * g.double()) @ w.double(), thw, 1e-6)
    assert_close("tgv_gate", c @ gp.double().t(), tgv[:, :m], 1e-6)
    assert_close("tgv_value", c @ a.double().t(), tgv[:, m:], 1e-6)
    assert_close("gram", w.double().t() @ w.double(), gram, 1e-6)


def test_tail_tables_rejects_bad_shapes():
    args, _ = make_case(1, 3, 20, 12, 10, 4, 50)
    bad = list(args)
    bad[3] = bad[3][:, :1]
    with pytest.raises(ValueError, match="cand_ids"):
        tt.tail_tables_ref(*bad)
