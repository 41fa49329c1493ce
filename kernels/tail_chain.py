"""The DSpine tail's serial chain over the K x K conditional tables.

Row 1 of a block reads predecessor slot j = 0 (all its predecessors are the
anchor); row t reads j = choice[t-1]. Over the K receiver scores of that table
row:

- greedy (temperature == 0): argmax, ties to the lower slot; q is one-hot;
- sampled: q = ``dspine.replica.sampling.probabilities`` semantics in float64
  (temperature; top-k keeping the k largest, ties to the lower slot; top-p on
  the top-k renormalised distribution, smallest prefix with mass >= top_p, the
  top slot always kept, top_p >= 1 disables it), then the inverse-CDF draw of
  ``sampling.sample``: the smallest slot with ``cumsum(q) > u * sum(q)``,
  never a zero-probability slot.

q is the exact distribution the slot was drawn from (zero outside the kept
slots), which verification needs for ``min(1, p / q)``. ``_tail_chain_kernel``
runs one program per block (one launch for the batch), serial over the BS-1
rows, with the factors in float64.
"""

from __future__ import annotations

import torch

from dspine import faults
from ._triton import USE_TRITON as _USE_TRITON, tl, triton

__all__ = ["tail_chain", "tail_chain_triton", "tail_chain_ref", "predecessor_slots"]


if triton is not None:

    @triton.jit
    def _tail_chain_kernel(
        scores_ptr,  # [NB, T, K, K] fp32 (j pred, i recv)
        cand_ptr,  # [NB, T, K] int64
        temp_ptr,  # [NB] float64
        top_k_ptr,  # [NB] int64
        top_p_ptr,  # [NB] float64
        u_ptr,  # [NB, T] float64 uniforms in [0, 1)
        draft_ptr,  # [NB, T] int64 out
        choice_ptr,  # [NB, T] int64 out
        q_ptr,  # [NB, T, K] float64 out
        T,
        K,
        BLOCK_K: tl.constexpr,
    ):
        i_n = tl.program_id(0)
        o_k = tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_temp = tl.load(temp_ptr + i_n).to(tl.float64)
        b_topk = tl.load(top_k_ptr + i_n).to(tl.int32)
        b_topp = tl.load(top_p_ptr + i_n).to(tl.float64)
        greedy = b_temp <= 0.0
        b_klim = tl.where(b_topk <= 0, BLOCK_K, b_topk)  # top_k 0 disables it
        b_plim = tl.where(b_topp >= 1.0, 2.0, b_topp)  # top_p 1 disables it (mass_before < 2 always)
        b_tsafe = tl.where(greedy, 1.0, b_temp)
        # [s, s'] helpers: s' strictly before s in slot order / at or before s
        before_slot = o_k[None, :] < o_k[:, None]
        upto_slot = (o_k[None, :] <= o_k[:, None]) & m_k[None, :]
        j = 0
        for t in range(0, T):
            row = i_n * T + t
            b_l = tl.load(scores_ptr + (row * K + j) * K + o_k, mask=m_k, other=float("-inf")).to(tl.float64)
            b_max = tl.max(b_l, axis=0)
            g_slot = tl.min(tl.where(m_k & (b_l == b_max), o_k, BLOCK_K), axis=0)

            b_z = (b_l - b_max) / b_tsafe
            # rank[s]: slots ahead of s in the (value desc, slot asc) order
            beats = ((b_z[None, :] > b_z[:, None]) | ((b_z[None, :] == b_z[:, None]) & before_slot)) & m_k[None, :]
            b_rank = tl.sum(beats.to(tl.int32), axis=1)
            keep = m_k & (b_rank < b_klim)
            b_e = tl.where(keep, tl.exp(tl.where(keep, b_z, 0.0)), 0.0)
            b_p = b_e / tl.sum(b_e, axis=0)
            mass_before = tl.sum(tl.where((b_rank[None, :] < b_rank[:, None]) & keep[None, :], b_p[None, :], 0.0), axis=1)
            keep = keep & (mass_before < b_plim)
            b_e = tl.where(keep, b_e, 0.0)
            b_q = b_e / tl.sum(b_e, axis=0)

            b_cdf = tl.sum(tl.where(upto_slot, b_q[None, :], 0.0), axis=1)
            b_u = tl.load(u_ptr + row).to(tl.float64) * tl.sum(b_q, axis=0)
            n_le = tl.sum((m_k & (b_cdf <= b_u)).to(tl.int32), axis=0)
            last_pos = tl.max(tl.where(b_q > 0.0, o_k, -1), axis=0)
            s_slot = tl.minimum(n_le, last_pos)

            slot = tl.where(greedy, g_slot, s_slot)
            b_q = tl.where(greedy, tl.where(o_k == slot, 1.0, 0.0).to(tl.float64), b_q)
            tl.store(q_ptr + row * K + o_k, b_q, mask=m_k)
            tl.store(choice_ptr + row, slot.to(tl.int64))
            tl.store(draft_ptr + row, tl.load(cand_ptr + row * K + slot))
            j = slot


def _check(scores, cand_ids, temperature, top_k, top_p, uniforms):
    nb, t, k, k2 = scores.shape
    if k != k2 or cand_ids.shape != (nb, t, k):
        raise ValueError(f"scores {list(scores.shape)}, cand_ids {list(cand_ids.shape)}: need [NB, T, K, K], [NB, T, K]")
    for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if v.shape != (nb,):
            raise ValueError(f"{name}: expected shape [{nb}] (one per block), got {list(v.shape)}")
    if uniforms.shape != (nb, t):
        raise ValueError(f"uniforms: expected shape [{nb}, {t}], got {list(uniforms.shape)}")


def tail_chain_triton(scores, cand_ids, temperature, top_k, top_p, uniforms):
    _check(scores, cand_ids, temperature, top_k, top_p, uniforms)
    nb, t, k, _ = scores.shape
    dev = scores.device
    draft_ids = torch.empty(nb, t, dtype=torch.int64, device=dev)
    choice = torch.empty(nb, t, dtype=torch.int64, device=dev)
    q = torch.empty(nb, t, k, dtype=torch.float64, device=dev)
    if nb == 0 or t == 0:
        return draft_ids, choice, q
    _tail_chain_kernel[(nb,)](
        scores.float().contiguous(), cand_ids.contiguous(), temperature.to(torch.float64).contiguous(),
        top_k.to(torch.int64).contiguous(), top_p.to(torch.float64).contiguous(),
        uniforms.to(torch.float64).contiguous(), draft_ids, choice, q, t, k,
        BLOCK_K=max(16, triton.next_power_of_2(k)),
    )
    return draft_ids, choice, q


def _row_q(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """``[NB, K]`` float64 logits -> q ``[NB, K]`` float64 (sampling.probabilities semantics)."""
    nb, k = logits.shape
    greedy = temperature <= 0
    z = (logits - logits.amax(dim=1, keepdim=True)) / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    sorted_z, order = torch.sort(z, dim=1, descending=True, stable=True)
    rank = torch.arange(k, device=logits.device)
    kk = torch.where(top_k <= 0, torch.full_like(top_k, k), top_k.clamp(max=k))
    kk = torch.where(greedy, torch.ones_like(kk), kk)
    keep = rank[None, :] < kk[:, None]
    p = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=1)
    mass_before = torch.cat([torch.zeros_like(p[:, :1]), p.cumsum(dim=1)[:, :-1]], dim=1)
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    q_sorted = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=1)
    return torch.zeros_like(q_sorted).scatter_(1, order, q_sorted)


def _greedy_chain_ref(scores, cand_ids):
    """All-greedy batch: the best receiver for every (row, predecessor) at once, then a
    walk through those small tables (the same choices as the general path)."""
    nb, t, k, _ = scores.shape
    best = scores.argmax(dim=-1).tolist()  # [NB][T][K(j)] slot of the best receiver; ties to the lower slot
    slots = []
    for block in best:
        j, path = 0, []
        for row in block:
            j = row[j]
            path.append(j)
        slots.append(path)
    choice = torch.tensor(slots, dtype=torch.int64, device=scores.device).view(nb, t)
    draft_ids = torch.gather(cand_ids, 2, choice[..., None])[..., 0]
    q = torch.zeros(nb, t, k, dtype=torch.float64, device=scores.device).scatter_(2, choice[..., None], 1.0)
    return draft_ids, choice, q


def predecessor_slots(choice: torch.Tensor) -> torch.Tensor:
    """``[NB, T]`` slot j of the table row each chain row reads: 0 for row 1 (every predecessor is
    the anchor), then the previous row's choice. choice [NB, T] int64."""
    if faults.active("tail.q_from_wrong_row"):
        return choice
    return torch.cat([torch.zeros_like(choice[:, :1]), choice[:, :-1]], dim=1)


def _row_q_unfiltered(logits: torch.Tensor, temperature) -> torch.Tensor:
    """``_row_q`` for rows with no top-k / top-p cut: the softmax at temperature (greedy rows: one-hot
    of the argmax, ties to the lower slot). No sort: the common sampled request pays for none."""
    greedy = temperature <= 0
    z = (logits - logits.amax(dim=1, keepdim=True)) / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    one_hot = torch.zeros_like(z).scatter_(1, z.argmax(dim=1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, torch.softmax(z, dim=1))


def _filters_inactive(temperature, top_k, top_p, k: int) -> bool:
    """No sampled block cuts its K candidates by top-k or top-p (greedy blocks need no cut either)."""
    sampled = temperature > 0
    cuts = sampled & (((top_k > 0) & (top_k < k)) | (top_p < 1.0))
    return not bool(cuts.any())


def tail_chain_ref(scores, cand_ids, temperature, top_k, top_p, uniforms):
    """Plain torch, float64 factors. q of every (row, predecessor) table row is computed at once
    (vectorised), and so is the slot each of them would draw with its row's coin (the inverse-CDF
    draw: the number of cdf entries <= u * cdf[-1], capped at the last slot with q > 0); the serial
    walk then only follows those slots, as the greedy walk follows its argmaxes."""
    _check(scores, cand_ids, temperature, top_k, top_p, uniforms)
    nb, t, k, _ = scores.shape
    dev = scores.device
    if nb and bool((temperature <= 0).all()):
        return _greedy_chain_ref(scores, cand_ids)
    per_block = t * k  # table rows per block
    temperature = temperature.to(torch.float64)
    rows = scores.reshape(nb * per_block, k).to(torch.float64)
    if _filters_inactive(temperature, top_k, top_p, k):
        q_all = _row_q_unfiltered(rows, temperature.repeat_interleave(per_block))
    else:
        q_all = _row_q(rows, temperature.repeat_interleave(per_block),
                       top_k.to(torch.int64).repeat_interleave(per_block),
                       top_p.to(torch.float64).repeat_interleave(per_block))
    q_all = q_all.view(nb, t, k, k)  # [NB, T, K(j), K(i)]
    cdf = q_all.cumsum(dim=-1)
    threshold = uniforms.to(torch.float64)[:, :, None] * cdf[..., -1]  # [NB, T, K(j)]
    drawn = (cdf <= threshold[..., None]).sum(dim=-1)
    last_pos = torch.where(q_all > 0, torch.arange(k, device=dev), -1).amax(dim=-1)
    next_slot = torch.minimum(drawn, last_pos).tolist()  # [NB][T][K(j)] slot drawn after predecessor j
    paths = []
    for block in next_slot:
        j, path = 0, []
        for row in block:
            j = row[j]
            path.append(j)
        paths.append(path)
    choice = torch.tensor(paths, dtype=torch.int64, device=dev).view(nb, t)
    pred = predecessor_slots(choice)
    q = q_all.gather(2, pred[:, :, None, None].expand(nb, t, 1, k)).squeeze(2)  # [NB, T, K]
    draft_ids = torch.gather(cand_ids, 2, choice[..., None])[..., 0]
    return draft_ids, choice, q


def tail_chain(scores, cand_ids, temperature, top_k, top_p, uniforms):
    """Dispatch: ``tail_chain_triton`` for CUDA tensors on a CUDA machine, else ``tail_chain_ref``."""
    fn = tail_chain_triton if (_USE_TRITON and scores.is_cuda) else tail_chain_ref
    return fn(scores, cand_ids, temperature, top_k, top_p, uniforms)
