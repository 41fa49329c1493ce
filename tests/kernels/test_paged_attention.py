"""Paged attention: the reference's causal rule, the Triton kernel vs the reference, and backend dispatch."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from dspine.kernels.paged_attention import paged_attention, paged_attention_ref, paged_backend


def make_inputs(lens, T, hq, hkv, hd, page, num_blocks=24, dtype=torch.float32, device="cpu", seed=3):
    torch.manual_seed(seed)
    width = -(-(max(lens) + T) // page)
    table = torch.zeros(len(lens), width, dtype=torch.int32)  # sink padding
    perm = torch.randperm(num_blocks - 1) + 1  # distinct blocks across requests, never the sink
    off = 0
    for b, L in enumerate(lens):
        n = -(-(L + T) // page)
        table[b, :n] = perm[off: off + n].int()
        off += n
    return dict(
        q=torch.randn(len(lens), T, hq, hd).to(device, dtype),
        k_cache=torch.randn(num_blocks, page, hkv, hd).to(device, dtype),
        v_cache=torch.randn(num_blocks, page, hkv, hd).to(device, dtype),
        block_table=table.to(device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
    )


def naive_f64(q, k_cache, v_cache, block_table, context_lens, scale):
    """Row t of request b attends positions 0..L_b + t, read one by one through the block table."""
    B, T, hq, hd = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(B, T, hq, hd, dtype=torch.float64)
    for b in range(B):
        L = int(context_lens[b])
        for t in range(T):
            pos = range(L + t + 1)
            for h in range(hq):
                kh = h // (hq // hkv)
                k = torch.stack([k_cache[block_table[b, p // page], p % page, kh] for p in pos]).double()
                v = torch.stack([v_cache[block_table[b, p // page], p % page, kh] for p in pos]).double()
                out[b, t, h] = torch.softmax(k @ q[b, t, h].double() * scale, 0) @ v
    return out


CASES = [  # lens, T, Hq, Hkv, hd, page
    pytest.param([5], 1, 2, 1, 8, 16, id="decode-b1"),
    pytest.param([0, 17, 40], 5, 4, 2, 24, 16, id="b3-ragged-hd24"),
    pytest.param([31, 3, 16, 0, 9, 47, 2, 20], 16, 8, 2, 16, 16, id="b8-verify16"),
    pytest.param([70], 3, 4, 4, 32, 32, id="page32-mha"),
]


@pytest.mark.parametrize("lens,T,hq,hkv,hd,page", CASES)
def test_reference_follows_the_causal_rule(lens, T, hq, hkv, hd, page):
    t = make_inputs(lens, T, hq, hkv, hd, page, dtype=torch.float64)
    scale = hd**-0.5
    assert torch.allclose(paged_attention_ref(**t, scale=scale), naive_f64(**t, scale=scale), atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens,T,hq,hkv,hd,page", CASES)
def test_triton_matches_reference(kernel_module, kernel_device, assert_close, lens, T, hq, hkv, hd, page, dtype):
    module = kernel_module("paged_attention")
    t = make_inputs(lens, T, hq, hkv, hd, page, dtype=dtype, device=kernel_device)
    scale = hd**-0.5
    ref = paged_attention_ref(**t, scale=scale)
    out = module.paged_attention_triton(**t, scale=scale)
    assert_close("paged_attention", ref, out, 2e-3 if dtype == torch.float32 else 2e-2)


def test_triton_refuses_pages_it_cannot_tile(kernel_module):
    module = kernel_module("paged_attention")
    t = make_inputs([3], 2, 2, 1, 8, 8)
    with pytest.raises(ValueError, match="power-of-two page >= 16"):
        module.paged_attention_triton(**t, scale=1.0)


# ---------------------------------------------------------------- dispatch
@pytest.fixture
def stub_flash_attn(monkeypatch):
    """A stand-in `flash_attn` module whose kernel records its call and answers with the reference."""
    calls = []

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
        calls.append(dict(cache_seqlens=cache_seqlens.tolist(), block_table=block_table, causal=causal))
        T = q.shape[1]
        return paged_attention_ref(q, k_cache, v_cache, block_table, cache_seqlens - T, softmax_scale)

    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


def test_cuda_pools_pick_flash_attn_when_it_imports(stub_flash_attn):
    assert paged_backend("cuda", 256) == "flash"
    assert paged_backend("cuda", 512) == "flash"
    assert paged_backend("cuda", 16) in ("triton", "torch")  # flash-attn 2 pages are multiples of 256
    assert paged_backend("cpu", 256) == "torch"


def test_without_flash_attn_cuda_pools_pick_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` now fails
    import importlib

    from dspine.kernels import _triton

    module = importlib.import_module("dspine.kernels.paged_attention")  # the package re-exports the function

    monkeypatch.setattr(module, "_flash_installed", lambda: False)
    assert paged_backend("cuda", 256) == ("triton" if _triton.triton is not None else "torch")
    assert paged_backend("cpu", 16) == "torch"


def test_flash_backend_passes_lengths_with_the_new_rows_and_the_block_table(stub_flash_attn):
    t = make_inputs([0, 17, 40], 5, 4, 2, 24, 16)
    out = paged_attention(**t, scale=24**-0.5, backend="flash")
    (call,) = stub_flash_attn
    assert call["cache_seqlens"] == [5, 22, 45] and call["causal"] is True
    assert call["block_table"].dtype == torch.int32 and torch.equal(call["block_table"], t["block_table"])
    assert torch.allclose(out, paged_attention_ref(**t, scale=24**-0.5))


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_target_reads_the_pool_in_place_through_each_backend(kernel_module, stub_flash_attn, monkeypatch, backend):
    """The target's CUDA wiring, run on CPU: forcing the in-place backend gives the torch path's logits,
    and nothing is gathered."""
    from dspine_testing.models import make_target

    module = kernel_module("paged_attention")
    model = make_target("tiny-qwen3")
    vocab = model.args.vocab_size
    logits = {}
    for name in ("torch", backend):
        monkeypatch.setattr(module, "paged_backend", lambda device, block_size, _n=name: _n)
        pool = model.new_kv_pool(16, 16)
        states = [model.new_state(kv_pool=pool, request_id=i) for i in range(3)]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (3, 17, 5)]
        model.forward_step(prompts, states)
        model.commit(states, [3, 17, 5])
        rows = [torch.randint(0, vocab, (n,), generator=g) for n in (4, 1, 6)]
        out = model.forward_step(rows, states)
        logits[name] = [out.logits[b, : len(r)] for b, r in enumerate(rows)]
        assert (pool.bytes_gathered == 0) == (name != "torch")
        for s in states:
            s.free()
    for ref, got in zip(logits["torch"], logits[backend]):
        assert torch.allclose(ref, got, atol=1e-4, rtol=1e-4)
    assert backend != "flash" or len(stub_flash_attn) == 2 * len(model.args.full_layer_ids)
