"""Building blocks shared by the attention kernels (draft attention, paged attention): a
grouped-query tile of query rows, and one online-softmax step over a tile of keys.

A tile row is one (query row, query head) pair of one KV head's group: row ``r`` of the tile
is query row ``r // G`` and head ``kv_head * G + r % G``, so one program serves every query head
that shares a KV head, and a decode step (one query row) still fills the tile with G rows.
"""

from __future__ import annotations

from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def gqa_query_tile(q_ptr, stride_qt, stride_qh, row0, num_rows, i_kh,
                       G: tl.constexpr, HD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                       UPCAST: tl.constexpr):
        """Load tile rows [row0, row0 + BLOCK_Q) of ``num_rows`` (= query rows x G) of one sequence.

        ``q_ptr`` points at the sequence's first query row. Returns the [BLOCK_Q, BLOCK_D] queries
        (fp32 when UPCAST), each tile row's query row and head, and the row and head-dim masks."""
        o_q = row0 + tl.arange(0, BLOCK_Q)
        o_d = tl.arange(0, BLOCK_D)
        m_q = o_q < num_rows
        m_d = o_d < HD
        o_t = o_q // G
        o_h = i_kh * G + o_q % G
        p_q = q_ptr + o_t[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_q[:, None] & m_d[None, :], other=0.0)
        if UPCAST:
            b_q = b_q.to(tl.float32)
        return b_q, o_t, o_h, m_q, o_d, m_d

    @triton.jit
    def online_softmax_step(b_q, b_k, b_v, b_visible, scale_log2, b_m, b_l, b_acc):
        """Fold one tile of keys into the running max ``b_m``, sum ``b_l`` and output ``b_acc``.

        b_q [BLOCK_Q, D], b_k / b_v [BLOCK_N, D], b_visible [BLOCK_Q, BLOCK_N] (False: masked out).
        Scores are in log2 units (``scale_log2`` = softmax scale x log2(e)) so exp2 can be used."""
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2
        b_s = tl.where(b_visible, b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp2(b_m - b_mn)
        b_p = tl.exp2(b_s - b_mn[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        return b_mn, b_l, b_acc

else:  # CPU-only installs: the kernels that use these are not defined either
    gqa_query_tile = online_softmax_step = None
