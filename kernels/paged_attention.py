"""Paged attention for the target's full-attention layers: new query rows over the request's pool blocks.

Semantics: request b has committed length L_b = context_lens[b] and T query
rows (its new tokens, padded to the batch's T) at positions L_b + t. Its K/V
(the new rows already written) live in `k_cache, v_cache [num_blocks,
block_size, Hkv, D]` (one layer of `PagedKVPool`), position p at block
block_table[b, p // block_size], offset p % block_size. Row t attends every
key at a position p <= L_b + t: causal over the new rows, full over the
context. Padded rows (t >= the request's own count) compute something finite
that the caller drops; block-table padding points at the pool's sink block.
GQA: query head h reads KV head h // (Hq / Hkv).

Backends (`paged_backend`):
- "flash": flash-attn's `flash_attn_with_kvcache(q, k_cache, v_cache,
  cache_seqlens=L + T, block_table=..., causal=True)`; its bottom-right causal
  alignment gives exactly the rule above. flash-attn 2 needs pages of a
  multiple of 256 tokens, so it is picked only for such pools on CUDA when
  `flash_attn` imports (it has no PyPI wheel: see the README).
- "triton": `_paged_attention_kernel`, one program per (request, KV head,
  tile of BLOCK_Q query rows x G heads): the K/V page is loaded once for the G
  query heads of its group, pages are streamed through the block table with an
  online softmax. Any power-of-two page >= 16.
- "torch": `paged_attention_ref`, a gather and one SDPA call (CPU; the
  target's CPU path does its own counted gather, see `models/target.py`).
Under the Triton interpreter (CPU, tests only) tiles are upcast to fp32 before
tl.dot, as in draft_attention.py.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import sys

import torch

from .attention_tiles import gqa_query_tile, online_softmax_step
from ._triton import tl, triton

FLASH_PAGE_MULTIPLE = 256  # flash-attn 2's paged KV needs page_block_size % 256 == 0


@functools.lru_cache(maxsize=None)
def _flash_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def flash_attn_kvcache():
    """flash-attn's `flash_attn_with_kvcache` when the module imports (a stub in sys.modules counts), else None."""
    module = sys.modules.get("flash_attn")
    if module is None:
        if not _flash_installed():
            return None
        try:
            module = importlib.import_module("flash_attn")
        except ImportError:  # installed but broken (e.g. built for another torch): fall back
            return None
    return getattr(module, "flash_attn_with_kvcache", None)


def paged_backend(device: torch.device | str, block_size: int) -> str:
    """Which implementation `paged_attention` runs for a pool on `device` with pages of `block_size`."""
    if torch.device(device).type != "cuda":
        return "torch"
    if block_size % FLASH_PAGE_MULTIPLE == 0 and flash_attn_kvcache() is not None:
        return "flash"
    if triton is not None and block_size >= 16 and block_size & (block_size - 1) == 0:
        return "triton"
    return "torch"


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,  # [B, T, Hq, D]
        k_ptr,  # [num_blocks, PAGE, Hkv, D]
        v_ptr,  # [num_blocks, PAGE, Hkv, D]
        table_ptr,  # [B, W] int32
        lens_ptr,  # [B] int32 committed length L_b
        out_ptr,  # [B, T, Hq, D]
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kp, stride_kh,
        stride_tb,
        stride_ob, stride_ot, stride_oh,
        T,
        scale_log2,  # softmax scale * log2(e)
        G: tl.constexpr,  # query heads per KV head
        HD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_Q: tl.constexpr,  # query rows (t, g) per program
        BLOCK_D: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        i_kh = tl.program_id(1)
        i_q = tl.program_id(2)
        b_q, o_t, o_h, m_q, o_d, m_d = gqa_query_tile(q_ptr + i_b * stride_qb, stride_qt, stride_qh,
                                                      i_q * BLOCK_Q, T * G, i_kh, G, HD, BLOCK_Q, BLOCK_D, UPCAST)

        L = tl.load(lens_ptr + i_b)
        o_qpos = L + o_t  # [BLOCK_Q] absolute position of each row
        last = L + (tl.minimum(i_q * BLOCK_Q + BLOCK_Q, T * G) - 1) // G + 1  # keys [0, last) can be visible here
        b_m = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
        b_l = tl.zeros([BLOCK_Q], dtype=tl.float32)
        b_acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
        o_p = tl.arange(0, PAGE)
        for j in range(0, tl.cdiv(last, PAGE)):
            blk = tl.load(table_ptr + i_b * stride_tb + j).to(tl.int64)
            o_k = j * PAGE + o_p  # key positions of this page
            o_kv = blk * stride_kb + o_p[:, None] * stride_kp + i_kh * stride_kh + o_d[None, :]
            b_k = tl.load(k_ptr + o_kv, mask=m_d[None, :], other=0.0)
            b_v = tl.load(v_ptr + o_kv, mask=m_d[None, :], other=0.0)
            if UPCAST:
                b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
            b_m, b_l, b_acc = online_softmax_step(b_q, b_k, b_v, o_k[None, :] <= o_qpos[:, None], scale_log2,
                                                  b_m, b_l, b_acc)

        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        p_o = out_ptr + i_b * stride_ob + o_t[:, None] * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_q[:, None] & m_d[None, :])


def _check(q, k_cache, v_cache, block_table, context_lens):
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, T, Hq, D] and k_cache [blocks, page, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}")
    B, T, Hq, D = q.shape
    _, page, Hkv, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match head dim {D}")
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {Hkv}")
    if block_table.dim() != 2 or block_table.shape[0] != B or tuple(context_lens.shape) != (B,):
        raise ValueError(f"block_table [B, W] / context_lens [B] with B={B}, got "
                         f"{tuple(block_table.shape)} / {tuple(context_lens.shape)}")
    return B, T, Hq, Hkv, D, page


def paged_attention_ref(q, k_cache, v_cache, block_table, context_lens, scale: float) -> torch.Tensor:
    """Reference: gather each request's positions [0, max L + T) through its block table, mask, SDPA.
    q [B, T, Hq, D]; k_cache, v_cache [blocks, page, Hkv, D]; block_table [B, W]; context_lens [B] -> [B, T, Hq, D]."""
    B, T, Hq, Hkv, D, page = _check(q, k_cache, v_cache, block_table, context_lens)
    dev = q.device
    lens = context_lens.to(dev, torch.int64)
    S = int(lens.max()) + T
    pos = torch.arange(S, device=dev)
    blocks = block_table.to(dev, torch.int64).gather(1, (pos // page).expand(B, S))  # (B, S)
    slots = blocks * page + pos % page
    f = torch.promote_types(q.dtype, torch.float32)
    keys = k_cache.reshape(-1, Hkv, D)[slots].to(f).transpose(1, 2)  # (B, Hkv, S, D)
    values = v_cache.reshape(-1, Hkv, D)[slots].to(f).transpose(1, 2)
    qpos = lens[:, None] + torch.arange(T, device=dev)  # (B, T)
    mask = (pos[None, None, :] <= qpos[:, :, None])[:, None]  # (B, 1, T, S)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).to(f), keys, values, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    return out.transpose(1, 2).to(q.dtype)


def paged_attention_triton(q, k_cache, v_cache, block_table, context_lens, scale: float) -> torch.Tensor:
    """`_paged_attention_kernel`; same signature and result as `paged_attention_ref`."""
    B, T, Hq, Hkv, D, page = _check(q, k_cache, v_cache, block_table, context_lens)
    if page < 16 or page & (page - 1):
        raise ValueError(f"the Triton paged kernel needs a power-of-two page >= 16, got {page}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache must share strides with a unit last stride")
    G = Hq // Hkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    block_q = min(64, max(16, triton.next_power_of_2(T * G)))
    _paged_attention_kernel[(B, Hkv, triton.cdiv(T * G, block_q))](
        q, k_cache, v_cache, table, lens, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        T, float(scale) * math.log2(math.e),
        G=G, HD=D, PAGE=page, BLOCK_Q=block_q, BLOCK_D=max(16, triton.next_power_of_2(D)),
        UPCAST=not q.is_cuda,
    )
    return out


def paged_attention_flash(q, k_cache, v_cache, block_table, context_lens, scale: float) -> torch.Tensor:
    """flash-attn's paged decode/verify kernel; same signature and result as `paged_attention_ref`."""
    T = q.shape[1]
    fn = flash_attn_kvcache()
    if fn is None:
        raise RuntimeError("flash_attn is not installed (see the README: GPU install)")
    seqlens = (context_lens.to(torch.int32) + T).contiguous()  # keys [0, L + T): bottom-right causal = row t sees L + t
    return fn(q.contiguous(), k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table.to(torch.int32),
              softmax_scale=scale, causal=True)


_BACKENDS = {"torch": paged_attention_ref, "triton": paged_attention_triton, "flash": paged_attention_flash}


def paged_attention(q, k_cache, v_cache, block_table, context_lens, scale: float,
                    backend: str | None = None) -> torch.Tensor:
    """Dispatch (see `paged_backend`; `backend` forces one). Shapes as `paged_attention_ref`."""
    backend = backend or paged_backend(q.device, k_cache.shape[1])
    return _BACKENDS[backend](q, k_cache, v_cache, block_table, context_lens, scale)
