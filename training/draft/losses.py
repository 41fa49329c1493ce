"""The drafter's losses: the parallel logits (main) and the serving tail's last-write rescoring (tail)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspine.replica.models.dspine import DSpineDrafter

from .labels import SoftLabels, block_labels


def row_weights(num_rows: int, gamma: float, device=None) -> torch.Tensor:
    """[num_rows] exp(-(k-1)/gamma) for rows k = 1..num_rows, normalised to sum 1."""
    w = torch.exp(-torch.arange(num_rows, device=device, dtype=torch.float32) / gamma)
    return w / w.sum()


def tail_hidden(drafter: DSpineDrafter, out, pred_ids: torch.Tensor) -> torch.Tensor:
    """The last bridge write of rows 1..BS-1 redone with the codes of given predecessor tokens.
    out: forward_train's DraftOut ([B, A, BS, ...]); pred_ids [B, A, BS-1] -> final-normed hidden
    [B, A, BS-1, H] (what the serving tail scores: head_i . RMSNorm_g(x_t + r_t W m_t(j)))."""
    br = drafter.bridge
    c_pred = math.sqrt(drafter.args.code_dim) * br.codebook[pred_ids]  # [B, A, BS-1, D]
    c_recv = out.codes[:, :, 1:]
    gate = torch.sigmoid(c_recv @ br.gate_recv.t() + c_pred @ br.gate_pred.t() + br.gate_bias)
    m = gate * (c_pred @ br.value_proj.t())  # [B, A, BS-1, M]
    x = out.x_last[:, :, 1:] + out.rms[:, :, 1:, None] * (m @ br.write_proj[-1].t())
    return drafter.norm(x)


def soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """-sum_j probs_j log softmax(logits)[ids_j] over the last dim: logits [..., V]; ids, probs [..., k]."""
    return -(probs * logits.log_softmax(-1).gather(-1, ids)).sum(-1)


def block_losses(drafter: DSpineDrafter, features: torch.Tensor, tokens: torch.Tensor, greedy: torch.Tensor,
                 anchors: torch.Tensor, weights: torch.Tensor, soft: SoftLabels | None = None,
                 soft_weight: float = 0.5, soft_temperature: float = 1.0) -> dict:
    """Main and tail losses of the blocks at ``anchors [B, A]`` plus acceptance statistics.

    The greedy label counts only while the sequence follows the target's greedy path (``valid``); the
    soft label (the target's distribution after the true prefix) is defined after any prefix, so it
    counts on every row, which is what a drafter for sampled continuations trains on.

    ``accept``: mean number of leading rows the serving greedy tail would get right (the label is among
    the K candidates of the parallel logits and wins the candidate-restricted tail score given the true
    predecessor); ``accept_main``: leading rows where the parallel argmax is right; with soft labels,
    ``accept_sampled``: the expected accepted length of a temperature-``soft_temperature`` request,
    sum over k of prod_{j<=k} sum_x min(p_j(x), q_j(x)), q the tail's distribution over its K candidates."""
    out = drafter.forward_train(features, tokens, anchors)
    labels, preds, valid = block_labels(tokens, greedy, anchors, drafter.args.block_size)  # [B, A, BS-1]
    logits = drafter.logits(out.hidden[:, :, 1:])  # [B, A, BS-1, V]
    tail_logits = drafter.logits(tail_hidden(drafter, out, preds))
    V = logits.shape[-1]
    ce_main = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view_as(labels)
    ce_tail = F.cross_entropy(tail_logits.reshape(-1, V), labels.reshape(-1), reduction="none").view_as(labels)
    ce_main, ce_tail = ce_main * valid, ce_tail * valid  # rows past the target's greedy path: no greedy label
    extra = {}
    if soft is not None:  # the target's distribution at the same positions as the greedy labels
        T = soft_temperature
        soft_ids, soft_probs = soft.at_blocks(anchors, drafter.args.block_size, T)
        ce_main = (1 - soft_weight) * ce_main + soft_weight * soft_cross_entropy(logits / T, soft_ids, soft_probs)
        ce_tail = (1 - soft_weight) * ce_tail + soft_weight * soft_cross_entropy(tail_logits / T, soft_ids, soft_probs)
        extra["accept_sampled"] = _expected_sampled_accept(logits, tail_logits, soft_ids, soft_probs, T,
                                                           drafter.args.head_topk)
    with torch.no_grad():
        K = drafter.args.head_topk
        cand = logits.topk(K, dim=-1).indices  # [B, A, BS-1, K]
        in_cand = (cand == labels[..., None]).any(-1)
        tail_pick = cand.gather(-1, tail_logits.gather(-1, cand).argmax(-1, keepdim=True)).squeeze(-1)
        hit_tail = in_cand & (tail_pick == labels) & valid
        hit_main = (logits.argmax(-1) == labels) & valid
    return {
        "main": (ce_main * weights).sum(-1).mean(),
        "tail": (ce_tail * weights).sum(-1).mean(),
        "accept": hit_tail.int().cumprod(-1).sum(-1).float().mean(),
        "accept_main": hit_main.int().cumprod(-1).sum(-1).float().mean(),
        "top1_row1": hit_main[..., 0].float().mean(),
        **extra,
    }


@torch.no_grad()
def _expected_sampled_accept(logits, tail_logits, soft_ids, soft_probs, temperature: float, num_candidates: int):
    """logits, tail_logits [B, A, R, V]; soft_ids, soft_probs [B, A, R, k] -> the mean expected accepted
    length: the tail samples among the parallel logits' top candidates from softmax(tail / T); a row is
    accepted with probability sum_x min(p(x), q(x)), x over the target's top k with p renormalised over them
    (the labels keep no more), which overstates p there; ``evaluate.expected_sampled_blocks`` is the
    held-out figure with the target's full p."""
    cand = logits.topk(num_candidates, dim=-1).indices  # [B, A, R, K]
    q_cand = (tail_logits.gather(-1, cand) / temperature).softmax(-1)  # [B, A, R, K]
    match = soft_ids[..., :, None] == cand[..., None, :]  # [B, A, R, k, K]
    q_at_p = (match * q_cand[..., None, :]).sum(-1)  # [B, A, R, k]
    alpha = torch.minimum(soft_probs, q_at_p).sum(-1)  # [B, A, R]
    return alpha.cumprod(-1).sum(-1).mean()

