"""Draft attention: a 16-row block attends to its request's context K/V in the draft pool plus itself.

Semantics (docs/contracts.md): block row r of request n sits at position
L_n + r (L_n = context_lens[n]); context entry i sits at position i. A query
at position P sees every key at a position p with P - window < p <= P:
causal inside the block, a sliding window over the context. Only position
*differences* enter the mask, so a ring pool that hands over just its last
<= window positions (with their own count as L_n) gives the same result as the
dense pool's full list. RoPE is already applied to q and to every key.

Why a Triton kernel rather than flash-attn varlen: the draft pool is a
token-granular (page size 1) slot pool, addressed through `context_slots`.
flash-attn's paged path (`flash_attn_with_kvcache`, block_table) needs pages
of 256 tokens in FA2, and its varlen path needs contiguous K/V, i.e. a copy of
up to `window` positions per layer per cycle. `_draft_attention_kernel` reads
the slots directly: one program per (request, KV head) holds all BS x G query
rows of that head group (GQA: the K/V tile is loaded once for G query heads),
streams the visible context range [max(0, L + 1 - window), L) in BLOCK_N tiles
with an online softmax, then the block's own BS keys with the causal mask.
Off CUDA, `draft_attention_torch` (a gather and one SDPA call) runs instead.
Under the Triton interpreter (CPU, tests only) tiles are upcast to fp32 before tl.dot,
because the Triton 3.9 interpreter's bf16 dot multiplies raw bit patterns.
For long windows and small batches a split-K variant would add parallelism;
at <= 8 requests x 8 KV heads this is the simple first version.
"""
from __future__ import annotations

import math

import torch

from .attention_tiles import gqa_query_tile, online_softmax_step
from ._triton import USE_TRITON as _USE_TRITON, tl, triton


if triton is not None:

    # stride_sn is Lmax, the longest context in the batch: it changes every cycle,
    # so it must not trigger a recompile (Triton specializes ints == 1 and % 16).
    @triton.jit(do_not_specialize=["stride_sn"])
    def _draft_attention_kernel(
        q_ptr,  # [NB, BS, Hq, hd]
        bk_ptr,  # [NB, BS, Hkv, hd] block keys
        bv_ptr,  # [NB, BS, Hkv, hd] block values
        pk_ptr,  # [S, Hkv, hd] pool keys (one layer)
        pv_ptr,  # [S, Hkv, hd] pool values (one layer)
        slots_ptr,  # [NB, Lmax] int64, padding -> slot 0
        lens_ptr,  # [NB] int64
        out_ptr,  # [NB, BS, Hq, hd]
        stride_qn, stride_qt, stride_qh,
        stride_bn, stride_bt, stride_bh,
        stride_ps, stride_ph,
        stride_sn,
        stride_on, stride_ot, stride_oh,
        window,
        scale_log2,  # softmax scale * log2(e)
        BS: tl.constexpr,
        G: tl.constexpr,  # query heads per KV head
        HD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_D: tl.constexpr,
        UPCAST: tl.constexpr,  # tl.dot in fp32 (CPU interpreter: its bf16 dot multiplies raw bits)
    ):
        i_n = tl.program_id(0).to(tl.int64)
        i_kh = tl.program_id(1)
        # o_r: the block row of each tile row
        b_q, o_r, o_h, m_q, o_d, m_d = gqa_query_tile(q_ptr + i_n * stride_qn, stride_qt, stride_qh,
                                                      0, BS * G, i_kh, G, HD, BLOCK_Q, BLOCK_D, UPCAST)

        L = tl.load(lens_ptr + i_n)
        o_qpos = L + o_r  # [BLOCK_Q]
        b_m = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
        b_l = tl.zeros([BLOCK_Q], dtype=tl.float32)
        b_acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

        lo = tl.maximum(L + 1 - window, 0)
        for start in range(lo, L, BLOCK_N):
            o_k = start + tl.arange(0, BLOCK_N)
            m_k = o_k < L
            b_slot = tl.load(slots_ptr + i_n * stride_sn + o_k, mask=m_k, other=0).to(tl.int64)
            m_kd = m_k[:, None] & m_d[None, :]
            o_kv = b_slot[:, None] * stride_ps + i_kh * stride_ph + o_d[None, :]
            b_k = tl.load(pk_ptr + o_kv, mask=m_kd, other=0.0)
            b_v = tl.load(pv_ptr + o_kv, mask=m_kd, other=0.0)
            if UPCAST:
                b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
            m_vis = m_k[None, :] & (o_k[None, :] > o_qpos[:, None] - window)
            b_m, b_l, b_acc = online_softmax_step(b_q, b_k, b_v, m_vis, scale_log2, b_m, b_l, b_acc)

        # the block's own keys: causal and windowed
        o_b = tl.arange(0, BLOCK_B)
        m_b = o_b < BS
        m_bd = m_b[:, None] & m_d[None, :]
        o_bkv = i_n * stride_bn + o_b[:, None] * stride_bt + i_kh * stride_bh + o_d[None, :]
        b_k = tl.load(bk_ptr + o_bkv, mask=m_bd, other=0.0)
        b_v = tl.load(bv_ptr + o_bkv, mask=m_bd, other=0.0)
        if UPCAST:
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
        o_kpos = L + o_b
        m_vis = (m_b[None, :] & (o_kpos[None, :] <= o_qpos[:, None])
                 & (o_kpos[None, :] > o_qpos[:, None] - window))
        b_m, b_l, b_acc = online_softmax_step(b_q, b_k, b_v, m_vis, scale_log2, b_m, b_l, b_acc)

        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]  # padded query rows see nothing
        p_o = out_ptr + i_n * stride_on + o_r[:, None] * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_q[:, None] & m_d[None, :])


def _check(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window):
    if q.dim() != 4 or block_k.dim() != 4:
        raise ValueError(f"q and block_k must be [NB, BS, heads, hd], got {tuple(q.shape)}, {tuple(block_k.shape)}")
    NB, BS, Hq, hd = q.shape
    Hkv = block_k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {Hkv}")
    if tuple(block_k.shape) != (NB, BS, Hkv, hd) or block_v.shape != block_k.shape:
        raise ValueError(f"block_k/block_v shapes {tuple(block_k.shape)}/{tuple(block_v.shape)} != {(NB, BS, Hkv, hd)}")
    if pool_k.dim() != 3 or tuple(pool_k.shape[1:]) != (Hkv, hd) or pool_v.shape != pool_k.shape:
        raise ValueError(f"pool_k/pool_v must be [S, {Hkv}, {hd}], got {tuple(pool_k.shape)}/{tuple(pool_v.shape)}")
    if context_slots.dim() != 2 or context_slots.shape[0] != NB or tuple(context_lens.shape) != (NB,):
        raise ValueError(f"context_slots [NB, Lmax] / context_lens [NB] with NB={NB}, got "
                         f"{tuple(context_slots.shape)} / {tuple(context_lens.shape)}")
    if window < 1:
        raise ValueError(f"window {window} must be >= 1")
    return NB, BS, Hq, Hkv, hd


def draft_attention_triton(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens,
                           window: int, scale: float) -> torch.Tensor:
    NB, BS, Hq, Hkv, hd = _check(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window)
    G = Hq // Hkv
    q, block_k, block_v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, block_k, block_v))
    if pool_k.stride(-1) != 1 or pool_k.stride() != pool_v.stride():
        raise ValueError("pool_k/pool_v must share strides with a unit last stride")
    slots = context_slots.contiguous()
    out = torch.empty(NB, BS, Hq, hd, dtype=q.dtype, device=q.device)
    _draft_attention_kernel[(NB, Hkv)](
        q, block_k, block_v, pool_k, pool_v, slots, context_lens.contiguous(), out,
        q.stride(0), q.stride(1), q.stride(2),
        block_k.stride(0), block_k.stride(1), block_k.stride(2),
        pool_k.stride(0), pool_k.stride(1),
        slots.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        int(window), float(scale) * math.log2(math.e),
        BS=BS, G=G, HD=hd,
        BLOCK_Q=max(16, triton.next_power_of_2(BS * G)), BLOCK_N=64,
        BLOCK_B=max(16, triton.next_power_of_2(BS)), BLOCK_D=max(16, triton.next_power_of_2(hd)),
        UPCAST=not q.is_cuda,
    )
    return out


def _visible_keys(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window: int):
    """The keys a block can see, gathered: ``(keys, values [NB, Wc + BS, Hkv, hd] in fp32 (fp64 for
    fp64 inputs), mask [NB, BS, Wc + BS] bool)`` with Wc = min(Lmax, window) context entries."""
    BS = q.shape[1]
    dev = q.device
    Wc = min(context_slots.shape[1], window)  # only the last `window` context entries can be visible
    lens = context_lens.to(dev, torch.int64)
    idx = lens[:, None] - Wc + torch.arange(Wc, device=dev)  # [NB, Wc] context index; negative = none
    slots = context_slots.to(dev).gather(1, idx.clamp(min=0))
    f = torch.promote_types(q.dtype, torch.float32)
    keys = torch.cat([pool_k[slots], block_k], 1).to(f)  # [NB, Wc + BS, Hkv, hd]
    values = torch.cat([pool_v[slots], block_v], 1).to(f)
    ar = torch.arange(BS, device=dev)
    kpos = torch.cat([idx, lens[:, None] + ar], 1)  # [NB, Wc + BS]
    distance = (lens[:, None] + ar)[:, :, None] - kpos[:, None, :]  # [NB, BS, Wc + BS] query - key position
    mask = (distance >= 0) & (distance < window) & (kpos >= 0)[:, None, :]
    return keys, values, mask


def draft_attention_ref(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens,
                        window: int, scale: float) -> torch.Tensor:
    NB, BS, Hq, Hkv, hd = _check(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window)
    keys, vals, mask = _visible_keys(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window)
    G = Hq // Hkv
    keys = keys.repeat_interleave(G, dim=2)  # [NB, Lk, Hq, hd]
    vals = vals.repeat_interleave(G, dim=2)
    s = torch.einsum("nthd,nshd->nhts", q.to(keys.dtype), keys) * scale  # (NB, Hq, BS, Lk)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("nhts,nshd->nthd", s.softmax(-1), vals)
    return out.to(q.dtype)


def draft_attention_torch(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens,
                          window: int, scale: float) -> torch.Tensor:
    """The CPU path: the reference's gather, then one fused SDPA call with GQA.

    Same maths as the reference (tested against it); it avoids materialising the repeated K/V
    heads and the score matrix, which on CPU costs more than the attention itself."""
    NB, BS, Hq, Hkv, hd = _check(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window)
    keys, vals, mask = _visible_keys(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).to(keys.dtype), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask[:, None],
        scale=scale, enable_gqa=Hq != Hkv)
    return out.transpose(1, 2).to(q.dtype)  # [NB, BS, Hq, hd]


def draft_attention(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens,
                    window: int, scale: float) -> torch.Tensor:
    """Dispatch: `draft_attention_triton` on CUDA tensors when Triton is available, else `draft_attention_torch`."""
    fn = draft_attention_triton if (_USE_TRITON and q.is_cuda) else draft_attention_torch
    return fn(q, block_k, block_v, pool_k, pool_v, context_slots, context_lens, window, scale)
