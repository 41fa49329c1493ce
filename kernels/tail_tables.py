"""K x K conditional score tables of the DSpine tail's last bridge write.

For proposal row t (1..BS-1) of a block, predecessor candidate j (token p_j,
code c_j = sqrt(D) codebook[p_j]) and receiver candidate i (token h_i):

    m(j)      = sigmoid(G c_t + b + Gp c_j) * (A c_j)                    [M]
    y(j)      = x_t + r_t W m(j)                                          [H]
    score[j,i] = head_i . RMSNorm_g(y(j)) = head_i . (g * y(j)) / n(j)
    n(j)      = sqrt(mean(y(j)^2) + eps)

with x_t the last layer's residual BEFORE its bridge write, r_t its RMS, c_t
the receiver's predicted code. Nothing of width H is recomputed per (j, i):

    head_i . (g * y(j)) = (g * head_i) . x_t + r_t * thw[h_i] . m(j)
    |y(j)|^2            = |x_t|^2 + 2 r_t (W^T x_t) . m(j) + r_t^2 m(j)^T (W^T W) m(j)

using the per-token tables built once per drafter by ``precompute_tail_tables``:
``token_head_write [V, M] = W^T (g * head_v)`` (thw), ``token_gate_value
[V, 2M] = [Gp c_v | A c_v]`` (tgv) and ``write_gram [M, M] = W^T W``.
Per row the host computes three GEMM-shaped terms for the whole batch at once
(``G c_t + b``, ``W^T x_t``, ``|x_t|^2``); ``_tail_tables_kernel`` (one program
per proposal row) gathers the candidates' table rows and the K head rows for
``(g * head_i) . x_t`` and writes the table.
"""

from __future__ import annotations

import math

import torch
from ._triton import USE_TRITON as _USE_TRITON, tl, triton

__all__ = ["tail_tables", "tail_tables_triton", "tail_tables_ref", "precompute_tail_tables"]


if triton is not None:

    @triton.jit
    def _m_tile(gr_ptr, tgv_ptr, p_rows, o_m, m_k, M):
        """m(j) restricted to message columns ``o_m``: [BLOCK_K, BLOCK_M] fp32 (0 outside)."""
        m_m = o_m < M
        m_2 = m_k[:, None] & m_m[None, :]
        b_gr = tl.load(gr_ptr + o_m, mask=m_m, other=0.0)
        b_gate = tl.load(tgv_ptr + p_rows[:, None] * (2 * M) + o_m[None, :], mask=m_2, other=0.0).to(tl.float32)
        b_val = tl.load(tgv_ptr + p_rows[:, None] * (2 * M) + M + o_m[None, :], mask=m_2, other=0.0).to(tl.float32)
        return tl.sigmoid(b_gr[None, :] + b_gate) * b_val


    @triton.jit
    def _tail_tables_kernel(
        x_ptr,  # [NB, BS, H] last layer's residual before its bridge write
        rms_ptr,  # [NB, BS]
        gr_ptr,  # [NB * (BS-1), M] fp32: G c_t + b
        u_ptr,  # [NB * (BS-1), M] fp32: W^T x_t
        xx_ptr,  # [NB * (BS-1)] fp32: |x_t|^2
        cand_ptr,  # [NB * (BS-1), K] int64 receiver candidate ids
        pred_ptr,  # [NB * (BS-1), K] int64 predecessor candidate ids
        tgv_ptr,  # [V, 2M] token_gate_value
        thw_ptr,  # [V, M] token_head_write
        gram_ptr,  # [M, M] W^T W
        head_ptr,  # [V, H] LM head
        g_ptr,  # [H] final norm weight
        scores_ptr,  # [NB * (BS-1), K, K] fp32 out, [j, i]
        BS,
        H,
        M,
        K,
        eps,
        BLOCK_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        i_row = tl.program_id(0)  # n * (BS-1) + (t-1)
        i_n = i_row // (BS - 1)
        i_t = i_row % (BS - 1) + 1
        o_k = tl.arange(0, BLOCK_K)
        m_k = o_k < K
        p_cand = tl.load(cand_ptr + i_row * K + o_k, mask=m_k, other=0)
        p_pred = tl.load(pred_ptr + i_row * K + o_k, mask=m_k, other=0)
        x_row = x_ptr + (i_n * BS + i_t).to(tl.int64) * H
        b_r = tl.load(rms_ptr + i_n * BS + i_t).to(tl.float32)
        b_xx = tl.load(xx_ptr + i_row)

        # hx[i] = (g * head_i) . x_t
        b_hx = tl.zeros([BLOCK_K], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            o_h = h0 + tl.arange(0, BLOCK_H)
            m_h = o_h < H
            b_gx = tl.load(x_row + o_h, mask=m_h, other=0.0).to(tl.float32) * \
                tl.load(g_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_w = tl.load(head_ptr + p_cand[:, None] * H + o_h[None, :], mask=m_k[:, None] & m_h[None, :],
                          other=0.0).to(tl.float32)
            b_hx += tl.sum(b_w * b_gx[None, :], axis=1)

        gr_row = gr_ptr + i_row * M
        b_wm = tl.zeros([BLOCK_K, BLOCK_K], dtype=tl.float32)  # [j, i] thw_i . m(j)
        b_xm = tl.zeros([BLOCK_K], dtype=tl.float32)  # [j] (W^T x_t) . m(j)
        b_mgm = tl.zeros([BLOCK_K], dtype=tl.float32)  # [j] m(j)^T (W^T W) m(j)
        for m0 in range(0, M, BLOCK_M):
            o_m = m0 + tl.arange(0, BLOCK_M)
            m_m = o_m < M
            b_m = _m_tile(gr_row, tgv_ptr, p_pred, o_m, m_k, M)
            b_thw = tl.load(thw_ptr + p_cand[:, None] * M + o_m[None, :], mask=m_k[:, None] & m_m[None, :],
                            other=0.0).to(tl.float32)
            b_wm = tl.dot(b_m, tl.trans(b_thw), b_wm, input_precision="ieee")
            b_u = tl.load(u_ptr + i_row * M + o_m, mask=m_m, other=0.0)
            b_xm += tl.sum(b_m * b_u[None, :], axis=1)
            b_gm = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)  # (m(j)^T Gram)[:, o_m]
            for m1 in range(0, M, BLOCK_M):
                o_m1 = m1 + tl.arange(0, BLOCK_M)
                b_m1 = _m_tile(gr_row, tgv_ptr, p_pred, o_m1, m_k, M)
                b_gw = tl.load(gram_ptr + o_m1[:, None] * M + o_m[None, :], mask=(o_m1 < M)[:, None] & m_m[None, :],
                               other=0.0).to(tl.float32)
                b_gm = tl.dot(b_m1, b_gw, b_gm, input_precision="ieee")
            b_mgm += tl.sum(b_gm * b_m, axis=1)

        b_n2 = (b_xx + 2.0 * b_r * b_xm + b_r * b_r * b_mgm) / H + eps
        b_sc = (b_hx[None, :] + b_r * b_wm) / tl.sqrt(b_n2)[:, None]
        tl.store(scores_ptr + i_row * K * K + o_k[:, None] * K + o_k[None, :], b_sc, mask=m_k[:, None] & m_k[None, :])


def precompute_tail_tables(codebook, gate_pred, value_proj, write_proj, head, final_norm_weight, *,
                           dtype: torch.dtype | None = None, chunk: int = 16384):
    """Per-drafter tables -> ``(token_head_write [V, M], token_gate_value [V, 2M], write_gram [M, M] fp32)``.

    ``token_head_write[v] = W^T (g * head_v)``, ``token_gate_value[v] = [Gp c_v | A c_v]``
    with ``c_v = sqrt(D) codebook[v]``; computed in fp32 in vocabulary chunks and
    stored in ``dtype`` (default: the head's dtype). Memory: ``V * 3M * bytes``
    (27B in BF16: 248,320 * 1,536 * 2 = 727.5 MiB) plus the ``M * M * 4`` byte
    Gram (1 MiB).
    """
    v, d = codebook.shape
    m = write_proj.shape[1]
    dtype = dtype or head.dtype
    dev = head.device
    w = write_proj.float()
    gp_a = torch.cat([gate_pred.float(), value_proj.float()], dim=0).t()  # [D, 2M]
    g = final_norm_weight.float()
    thw = torch.empty(v, m, dtype=dtype, device=dev)
    tgv = torch.empty(v, 2 * m, dtype=dtype, device=dev)
    for s in range(0, v, chunk):
        thw[s:s + chunk] = ((head[s:s + chunk].float() * g) @ w).to(dtype)
        tgv[s:s + chunk] = ((codebook[s:s + chunk].float() * math.sqrt(d)) @ gp_a).to(dtype)
    return thw, tgv, (w.t() @ w).contiguous()


def _check(x_last, rms, recv_codes, cand_ids, pred_ids):
    nb, bs, h = x_last.shape
    if bs < 2 or rms.shape != (nb, bs) or recv_codes.shape[:2] != (nb, bs):
        raise ValueError(f"x_last {list(x_last.shape)}, rms {list(rms.shape)}, recv_codes {list(recv_codes.shape)}: "
                         "need [NB, BS, H], [NB, BS], [NB, BS, D] with BS >= 2")
    if cand_ids.dim() != 3 or cand_ids.shape[:2] != (nb, bs - 1) or pred_ids.shape != cand_ids.shape:
        raise ValueError(f"cand_ids {list(cand_ids.shape)}, pred_ids {list(pred_ids.shape)}: need [NB, BS-1, K]")


def _row_terms(x_last, rms, recv_codes, gate_recv, gate_bias, write_proj):
    """Per proposal row: (x_t, r_t, G c_t + b, W^T x_t, |x_t|^2), fp32, one GEMM each for the batch."""
    xs = x_last[:, 1:].float()
    gr = recv_codes[:, 1:].float() @ gate_recv.float().t() + gate_bias.float()
    u = xs @ write_proj.float()
    return xs, rms[:, 1:].float(), gr, u, (xs * xs).sum(-1)


def tail_tables_triton(x_last, rms, recv_codes, cand_ids, pred_ids, gate_recv, gate_bias, token_gate_value,
                       token_head_write, write_gram, write_proj, head, final_norm_weight, eps: float):
    _check(x_last, rms, recv_codes, cand_ids, pred_ids)
    nb, bs, h = x_last.shape
    k = cand_ids.shape[2]
    m = write_proj.shape[1]
    _, _, gr, u, xx = _row_terms(x_last, rms, recv_codes, gate_recv, gate_bias, write_proj)
    scores = torch.empty(nb, bs - 1, k, k, dtype=torch.float32, device=x_last.device)
    _tail_tables_kernel[(nb * (bs - 1),)](
        x_last.contiguous(), rms.contiguous(), gr.contiguous(), u.contiguous(), xx.contiguous(),
        cand_ids.contiguous(), pred_ids.contiguous(), token_gate_value.contiguous(), token_head_write.contiguous(),
        write_gram.contiguous(), head.contiguous(), final_norm_weight.contiguous(), scores,
        bs, h, m, k, float(eps),
        BLOCK_K=max(16, triton.next_power_of_2(k)), BLOCK_H=min(256, max(16, triton.next_power_of_2(h))),
        BLOCK_M=min(64, max(16, triton.next_power_of_2(m))),
    )
    return scores


def tail_tables_ref(x_last, rms, recv_codes, cand_ids, pred_ids, gate_recv, gate_bias, token_gate_value,
                    token_head_write, write_gram, write_proj, head, final_norm_weight, eps: float):
    """Plain torch, fp32 maths, the same factorisation: ``scores [NB, BS-1, K (pred j), K (recv i)]``."""
    _check(x_last, rms, recv_codes, cand_ids, pred_ids)
    h = x_last.shape[2]
    m = write_proj.shape[1]
    xs, r, gr, u, xx = _row_terms(x_last, rms, recv_codes, gate_recv, gate_bias, write_proj)
    hx = torch.einsum("ntkh,nth->ntk", head[cand_ids].float(), xs * final_norm_weight.float())
    tgv = token_gate_value[pred_ids].float()  # [NB, T, K(j), 2M]
    msg = torch.sigmoid(gr[:, :, None, :] + tgv[..., :m]) * tgv[..., m:]  # [NB, T, K(j), M]
    wm = torch.einsum("ntjm,ntim->ntji", msg, token_head_write[cand_ids].float())
    xm = torch.einsum("ntjm,ntm->ntj", msg, u)
    mgm = torch.einsum("ntjm,ntjm->ntj", msg @ write_gram.float(), msg)
    n2 = (xx[..., None] + 2.0 * r[..., None] * xm + r[..., None] ** 2 * mgm) / h + eps
    return (hx[:, :, None, :] + r[..., None, None] * wm) * torch.rsqrt(n2)[..., None]


def tail_tables(x_last, rms, recv_codes, cand_ids, pred_ids, gate_recv, gate_bias, token_gate_value,
                token_head_write, write_gram, write_proj, head, final_norm_weight, eps: float):
    """Dispatch: ``tail_tables_triton`` for CUDA tensors on a CUDA machine, else ``tail_tables_ref``."""
    fn = tail_tables_triton if (_USE_TRITON and x_last.is_cuda) else tail_tables_ref
    return fn(x_last, rms, recv_codes, cand_ids, pred_ids, gate_recv, gate_bias, token_gate_value, token_head_write,
              write_gram, write_proj, head, final_norm_weight, eps)
