"""FP8 candidate retrieval for the DSpine tail: approximate scan, exact rescore.

For each hidden row the tail needs the ``k`` (16) best tokens of the shared LM
head. Scoring all V (248,320) rows in BF16 is the single largest read of the
tail, so the fast path reads a row-scaled FP8 copy of the head instead (half
the bytes), keeps the ``num_retrieve`` (128) best approximate scores, rescores
only those with the real head and keeps the ``k`` best of them:

1. ``_fp8_head_scores_kernel``: tiled GEMM ``hidden [N, H] x head_fp8^T``
   times the per-row scale into an fp32 workspace ``[N, V]`` (V need not be a
   multiple of the tile). Row blocks of the same vocabulary tile are launched
   next to each other, so the head is read from HBM about once per batch.
2. ``_fp8_head_topk_kernel``: per vocabulary tile of ``TILE_V`` entries, an
   in-register sort of ``(score, id)`` keys and the tile's top ``R``.
3. merge (``torch.topk`` over the ``ceil(V / TILE_V) * R`` tile winners; the
   int64 keys are unique, so the result is deterministic), then rescoring with
   the real head in fp32 and a stable sort: logit descending, ties to the
   lower token id.

Approximation (documented, tested): rescoring only reorders what step 2
retrieved. If a token of the exact top ``k`` has an FP8 score outside the top
``R`` (e.g. a head row whose outlier coordinate sets a scale that rounds its
useful coordinates to zero) it is missed. The tail is a proposal, so this only
costs acceptance, never correctness; the fallback (``head_topk_exact``) scores
the real head directly.

``quantize_head_fp8`` builds the row-scaled e4m3 copy once per model
(``scale = amax(|row|) / 448``). Where torch lacks ``float8_e4m3fn`` (or with
``emulate=True``) it returns fp32 storage holding e4m3-rounded values;
every function here accepts either storage.
"""

from __future__ import annotations

import torch
from ._triton import USE_TRITON as _USE_TRITON, tl, triton

__all__ = [
    "fp8_head_topk",
    "fp8_head_topk_triton",
    "fp8_head_topk_ref",
    "quantize_head_fp8",
    "round_to_e4m3",
    "head_topk_exact",
    "FP8_E4M3_MAX",
]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_E4M3_MIN_NORMAL_EXP = -6  # 2**-6 is the smallest normal; subnormal step 2**-9
_HAS_FP8 = hasattr(torch, "float8_e4m3fn")
_KEY_ID_MAX = 0x7FFFFFFF  # ids are packed as (_KEY_ID_MAX - id): larger key = lower id


if triton is not None:

    @triton.jit(do_not_specialize=["N"])  # N = blocks * 15 changes with the batch: no recompiles
    def _fp8_head_scores_kernel(
        hidden_ptr,  # [N, H] any float
        head_fp8_ptr,  # [V, H] float8_e4m3fn or fp32 holding e4m3 values
        head_scale_ptr,  # [V] fp32
        scores_ptr,  # [N, V] fp32 out: (hidden . head_fp8[v]) * scale[v]
        N,
        V,
        H,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_H: tl.constexpr,
        DOT_BF16: tl.constexpr,  # True on GPU: bf16 tensor-core dot (e4m3 is exact in bf16)
    ):
        i_n = tl.program_id(0)  # row blocks vary fastest: they share one head tile in L2
        i_v = tl.program_id(1)
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
        m_n = o_n < N
        m_v = o_v < V
        b_acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            o_h = h0 + tl.arange(0, BLOCK_H)
            m_h = o_h < H
            b_x = tl.load(hidden_ptr + o_n[:, None].to(tl.int64) * H + o_h[None, :],
                          mask=m_n[:, None] & m_h[None, :], other=0.0)
            b_w = tl.load(head_fp8_ptr + o_v[:, None].to(tl.int64) * H + o_h[None, :],
                          mask=m_v[:, None] & m_h[None, :], other=0.0)
            if DOT_BF16:
                b_acc = tl.dot(b_x.to(tl.bfloat16), tl.trans(b_w.to(tl.bfloat16)), b_acc)
            else:
                b_acc = tl.dot(b_x.to(tl.float32), tl.trans(b_w.to(tl.float32)), b_acc, input_precision="ieee")
        b_s = tl.load(head_scale_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_acc = b_acc * b_s[None, :]
        tl.store(scores_ptr + o_n[:, None].to(tl.int64) * V + o_v[None, :], b_acc,
                 mask=m_n[:, None] & m_v[None, :])


    @triton.jit
    def _fp8_head_topk_kernel(
        scores_ptr,  # [N, V] fp32
        keys_ptr,  # [N, num_tiles, R] int64 out: the tile's R best (score, id) keys, descending
        V,
        num_tiles,
        R: tl.constexpr,
        TILE_V: tl.constexpr,
    ):
        i_n = tl.program_id(0)
        i_t = tl.program_id(1)
        o_v = i_t * TILE_V + tl.arange(0, TILE_V)
        m_v = o_v < V
        b_s = tl.load(scores_ptr + i_n.to(tl.int64) * V + o_v, mask=m_v, other=0.0)
        # Order-preserving int32 image of the float, then (score, -id) packed in int64.
        b_bits = b_s.to(tl.int32, bitcast=True)
        b_ord = tl.where(b_bits >= 0, b_bits, b_bits ^ 0x7FFFFFFF)
        b_key = (b_ord.to(tl.int64) << 32) | (0x7FFFFFFF - o_v).to(tl.int64)
        b_key = tl.where(m_v, b_key, -9223372036854775807 - 1)  # padding sorts last
        b_key = tl.sort(b_key, descending=True)
        o_r = tl.arange(0, TILE_V)
        tl.store(keys_ptr + (i_n.to(tl.int64) * num_tiles + i_t) * R + o_r, b_key, mask=o_r < R)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest float8_e4m3fn value (ties to even), kept as fp32.

    Saturates at +-448 (callers pre-scale so |x| <= 448). Equals
    ``x.to(torch.float8_e4m3fn).float()`` wherever torch has the dtype.
    """
    x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    _, e = torch.frexp(x)  # |x| = m * 2**e, m in [0.5, 1)
    exp = (e - 1).clamp(min=_E4M3_MIN_NORMAL_EXP)  # floor(log2|x|), subnormals share 2**-6
    step = torch.ldexp(torch.ones_like(x), exp - 3)  # 3 mantissa bits
    return (torch.round(x / step) * step).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)


def quantize_head_fp8(head: torch.Tensor, *, emulate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-scaled e4m3 copy of ``head [V, H]`` -> ``(head_fp8 [V, H], head_scale [V] fp32)``.

    ``head ~= head_fp8.float() * head_scale[:, None]``. ``head_fp8`` is
    ``float8_e4m3fn`` (V*H bytes: 1.18 GiB for the 27B head) unless ``emulate``
    (default: when torch lacks the dtype), then fp32 holding e4m3 values.
    Built in row chunks so the fp32 temporaries stay small.
    """
    if head.dim() != 2:
        raise ValueError(f"head: expected [V, H], got {list(head.shape)}")
    emulate = (not _HAS_FP8) if emulate is None else emulate
    v, h = head.shape
    out = torch.empty(v, h, dtype=torch.float32 if emulate else torch.float8_e4m3fn, device=head.device)
    scale = torch.empty(v, dtype=torch.float32, device=head.device)
    chunk = max(1, (1 << 26) // max(h, 1))
    for s in range(0, v, chunk):
        rows = head[s:s + chunk].float()
        sc = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_E4M3_MAX
        q = (rows / sc[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        out[s:s + chunk] = round_to_e4m3(q) if emulate else q.to(torch.float8_e4m3fn)
        scale[s:s + chunk] = sc
    return out, scale


def _topk_by_logit(logits: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of ``(logits, ids) [N, C]``: logit descending, ties to the lower id."""
    if k < logits.shape[1]:
        # Fast path: torch.topk is exact whenever no two of the k + 1 best logits are
        # equal (then the order is unique); only tied rows need the two stable sorts.
        values, order = torch.topk(logits, k + 1, dim=1)
        if bool((values[:, :-1] > values[:, 1:]).all()):
            return torch.gather(ids, 1, order[:, :k]).contiguous(), values[:, :k].contiguous()
    ids_sorted, perm = torch.sort(ids, dim=1, stable=True)
    logits = torch.gather(logits, 1, perm)
    logits, order = torch.sort(logits, dim=1, descending=True, stable=True)
    ids_sorted = torch.gather(ids_sorted, 1, order)
    return ids_sorted[:, :k].contiguous(), logits[:, :k].contiguous()


def _rescore(hidden: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, k: int):
    """Exact fp32 logits of the retrieved ``ids [N, R]`` and their top ``k``."""
    rows = head[ids].float()  # [N, R, H]
    logits = torch.einsum("nrh,nh->nr", rows, hidden.float())
    return _topk_by_logit(logits, ids, k)


def _check(hidden, head_fp8, head_scale, head, num_retrieve, k) -> int:
    n, h = hidden.shape
    v = head.shape[0]
    if head.shape != (v, h) or head_fp8.shape != (v, h) or head_scale.shape != (v,):
        raise ValueError(
            f"shapes: hidden {list(hidden.shape)}, head_fp8 {list(head_fp8.shape)}, "
            f"head_scale {list(head_scale.shape)}, head {list(head.shape)}: need [N, H], [V, H], [V], [V, H]"
        )
    r = min(num_retrieve, v)
    if not 1 <= k <= r:
        raise ValueError(f"k: need 1 <= k ({k}) <= min(num_retrieve, V) ({r})")
    return r


def head_topk_exact(hidden: torch.Tensor, head: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback retrieval: full fp32 logits against the real head, top ``k`` (ties to lower id).

    ``(cand_ids [N, k] int64, cand_logits [N, k] fp32)``, chunked over the vocabulary.
    """
    v = head.shape[0]
    x = hidden.float()
    logits = x.new_zeros(x.shape[0], v)
    chunk = max(1, (1 << 26) // max(head.shape[1], 1))  # fp32 copies of at most 256 MiB of head rows
    for s in range(0, v, chunk):
        logits[:, s:s + chunk] = x @ head[s:s + chunk].float().t()
    ids = torch.arange(v, device=hidden.device).expand_as(logits)
    return _topk_by_logit(logits, ids, k)


def head_topk_bf16(hidden: torch.Tensor, head_bf16: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU retrieval on cores with native bf16 GEMMs (AVX512-BF16, AMX): one bf16 scan of a bf16
    copy of the head, top ``k`` of those scores, no rescoring.

    ``(cand_ids [N, k] int64, approximate logits [N, k] fp32)``. Like the FP8 path it can swap a
    candidate near the k-th place for its neighbour (bf16 keeps 8 mantissa bits); that only
    changes what is proposed, never what verification emits. Rescoring the way the FP8 path
    does would need a gather of R head rows per row, which costs more than the scan on CPU."""
    logits = torch.nn.functional.linear(hidden.to(head_bf16.dtype), head_bf16).float()  # [N, V]
    # bf16 scores tie often; ordering ties by id (as _topk_by_logit does) costs more than the scan
    # on CPU, so ties keep torch.topk's order (deterministic for a given input on a given build).
    values, top_ids = torch.topk(logits, k, dim=1)
    return top_ids, values


def fp8_head_topk_triton(hidden, head_fp8, head_scale, head, num_retrieve: int, k: int, *,
                         tile_v: int = 2048, block_v: int = 128, block_n: int = 64, block_h: int = 64):
    r = _check(hidden, head_fp8, head_scale, head, num_retrieve, k)
    n, h = hidden.shape
    v = head.shape[0]
    hidden = hidden.contiguous()
    head_fp8 = head_fp8.contiguous()
    tile_v = max(triton.next_power_of_2(r), tile_v)
    block_n = max(16, min(block_n, triton.next_power_of_2(n)))
    block_v = max(16, block_v)
    block_h = max(16, block_h)
    scores = torch.empty(n, v, dtype=torch.float32, device=hidden.device)
    _fp8_head_scores_kernel[(triton.cdiv(n, block_n), triton.cdiv(v, block_v))](
        hidden, head_fp8, head_scale, scores, n, v, h,
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, DOT_BF16=hidden.is_cuda,
    )
    num_tiles = triton.cdiv(v, tile_v)
    keys = torch.empty(n, num_tiles, r, dtype=torch.int64, device=hidden.device)
    _fp8_head_topk_kernel[(n, num_tiles)](scores, keys, v, num_tiles, R=r, TILE_V=tile_v)
    keys = torch.topk(keys.view(n, num_tiles * r), r, dim=1).values  # unique keys: deterministic
    ids = _KEY_ID_MAX - (keys & 0xFFFFFFFF)
    return _rescore(hidden, head, ids, k)


def fp8_head_topk_ref(hidden, head_fp8, head_scale, head, num_retrieve: int, k: int, **_tiles):
    """Plain torch, fp32 maths: the same approximate scores, top R (ties to lower id), exact rescore."""
    r = _check(hidden, head_fp8, head_scale, head, num_retrieve, k)
    v = head.shape[0]
    approx = (hidden.float() @ head_fp8.float().t()) * head_scale.float()[None, :]
    ids = torch.arange(v, device=hidden.device).expand_as(approx)
    retrieved, _ = _topk_by_logit(approx, ids, r)
    return _rescore(hidden, head, retrieved, k)


def fp8_head_topk(hidden, head_fp8, head_scale, head, num_retrieve: int, k: int, **tiles):
    """Dispatch: ``fp8_head_topk_triton`` for CUDA tensors on a CUDA machine, else ``fp8_head_topk_ref``."""
    fn = fp8_head_topk_triton if (_USE_TRITON and hidden.is_cuda) else fp8_head_topk_ref
    return fn(hidden, head_fp8, head_scale, head, num_retrieve, k, **tiles)
