"""Draft attention: the reference's window/causal semantics and the Triton kernel vs the reference."""
from __future__ import annotations

import math

import pytest
import torch

from dspine.kernels.draft_attention import draft_attention, draft_attention_ref, draft_attention_torch


def make_inputs(lens, bs, hq, hkv, hd, num_slots=300, dtype=torch.float32, device="cpu", seed=42):
    torch.manual_seed(seed)
    nb, lmax = len(lens), max(max(lens), 1)
    slots = torch.zeros(nb, lmax, dtype=torch.int64)  # padding -> slot 0
    perm = torch.randperm(num_slots - 1) + 1  # distinct slots across requests, never slot 0
    off = 0
    for n, L in enumerate(lens):
        slots[n, :L] = perm[off: off + L]
        off += L
    t = dict(
        q=torch.randn(nb, bs, hq, hd), block_k=torch.randn(nb, bs, hkv, hd), block_v=torch.randn(nb, bs, hkv, hd),
        pool_k=torch.randn(num_slots, hkv, hd), pool_v=torch.randn(num_slots, hkv, hd),
    )
    t = {k: v.to(device, dtype) for k, v in t.items()}
    t["context_slots"] = slots.to(device)
    t["context_lens"] = torch.tensor(lens, dtype=torch.int64, device=device)
    return t


def naive_f64(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window, scale):
    """Per request, per head, per query: the contract's rule spelled out in float64."""
    nb, bs, hq, hd = q.shape
    g = hq // block_k.shape[2]
    out = torch.zeros(nb, bs, hq, hd, dtype=torch.float64)
    for n in range(nb):
        L = int(context_lens[n])
        keys = [(p, context_slots[n, p], None) for p in range(L)] + [(L + r, None, r) for r in range(bs)]
        for h in range(hq):
            kh = h // g
            for r in range(bs):
                P = L + r
                ks, vs = [], []
                for p, slot, br in keys:
                    if P - window < p <= P:
                        ks.append(pool_k[slot, kh] if br is None else block_k[n, br, kh])
                        vs.append(pool_v[slot, kh] if br is None else block_v[n, br, kh])
                k, v = torch.stack(ks).double(), torch.stack(vs).double()
                w = torch.softmax((k @ q[n, r, h].double()) * scale, 0)
                out[n, r, h] = w @ v
    return out


CASES = [  # lens, BS, Hq, Hkv, hd, window
    pytest.param([5], 1, 2, 1, 8, 100, id="nb1-bs1"),
    pytest.param([1, 63, 0], 5, 6, 2, 24, 7, id="nb3-lens1,63,0-win7"),
    pytest.param([63, 20, 9], 16, 4, 2, 16, 300, id="nb3-bs16-bigwin"),
    pytest.param([70], 16, 4, 4, 60, 16, id="nb1-hd60-win16"),
    pytest.param([3, 4], 4, 4, 1, 12, 1, id="win1-self-only"),
]


@pytest.mark.parametrize("lens,bs,hq,hkv,hd,window", CASES)
def test_ref_matches_naive(lens, bs, hq, hkv, hd, window, assert_close):
    inp = make_inputs(lens, bs, hq, hkv, hd)
    scale = 1 / math.sqrt(hd)
    out = draft_attention_ref(**inp, window=window, scale=scale)
    assert_close("out", naive_f64(**inp, window=window, scale=scale), out, 1e-5)


def test_window_one_sees_only_itself():
    inp = make_inputs([4, 2], 3, 2, 1, 8)
    out = draft_attention_ref(**inp, window=1, scale=0.3)
    torch.testing.assert_close(out, inp["block_v"].repeat_interleave(2, dim=2))


def test_padding_slot_and_stale_slots_are_ignored():
    """Entries past context_lens (pointing anywhere) and keys outside the window do not matter."""
    inp = make_inputs([10, 3], 4, 4, 2, 16)
    a = draft_attention_ref(**inp, window=6, scale=0.25)
    inp["context_slots"][1, 3:] = inp["context_slots"][0, 3]  # stale entries past len
    inp["pool_k"][0] = 1e3  # the padding sink
    inp["pool_k"][inp["context_slots"][0, :10 - 6 + 1]] = 1e3  # positions 0..4: outside every row's window
    b = draft_attention_ref(**inp, window=6, scale=0.25)
    torch.testing.assert_close(a, b)


DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 2e-2, id="bf16")]


@pytest.mark.parametrize("dtype,ratio", DTYPES)
@pytest.mark.parametrize("lens,bs,hq,hkv,hd,window", CASES)
def test_triton_matches_ref(lens, bs, hq, hkv, hd, window, dtype, ratio, kernel_module, kernel_device, assert_close):
    mod = kernel_module("draft_attention")
    inp = make_inputs(lens, bs, hq, hkv, hd, dtype=dtype, device=kernel_device)
    scale = 1 / math.sqrt(hd)
    ref = mod.draft_attention_ref(**inp, window=window, scale=scale)
    out = mod.draft_attention_triton(**inp, window=window, scale=scale)  # output from poisoned torch.empty
    if dtype == torch.float32 and kernel_device == "cuda":
        ratio = 2e-3  # tl.dot runs fp32 inputs as TF32 on GPUs
    assert out.dtype == dtype
    assert_close("out", ref, out, ratio)


def test_triton_reads_pool_views(kernel_module, kernel_device, assert_close):
    """pool_k / pool_v as strided views of one [layers, 2, S, Hkv, hd] buffer (as the drafter passes them)."""
    mod = kernel_module("draft_attention")
    inp = make_inputs([9, 33], 16, 4, 2, 16, num_slots=64, device=kernel_device)
    kv = torch.randn(3, 2, 64, 2, 16, device=kernel_device)
    inp["pool_k"], inp["pool_v"] = kv[1, 0], kv[1, 1]
    ref = mod.draft_attention_ref(**inp, window=20, scale=0.25)
    out = mod.draft_attention_triton(**inp, window=20, scale=0.25)
    assert_close("out", ref, out, 1e-5 if kernel_device == "cpu" else 2e-3)


@pytest.mark.parametrize("dtype,ratio", DTYPES)
@pytest.mark.parametrize("lens,bs,hq,hkv,hd,window", CASES)
def test_torch_path_matches_ref(lens, bs, hq, hkv, hd, window, dtype, ratio, assert_close):
    """The CPU path (gather + one SDPA call) against the reference, stale slots included."""
    inp = make_inputs(lens, bs, hq, hkv, hd, dtype=dtype)
    inp["pool_k"][0] = 1e3  # the padding sink must stay invisible
    scale = 1 / math.sqrt(hd)
    ref = draft_attention_ref(**inp, window=window, scale=scale)
    out = draft_attention_torch(**inp, window=window, scale=scale)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close("out", ref, out, ratio)


def test_dispatch_off_cuda_is_the_torch_path():
    inp = make_inputs([7, 2], 16, 4, 2, 16)
    out = draft_attention(**inp, window=5, scale=0.25)
    assert torch.equal(out, draft_attention_torch(**inp, window=5, scale=0.25))
