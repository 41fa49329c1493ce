"""Lossless verification of a drafted block against the target.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling"): the committed tokens are distributed
exactly as if sampled from the target alone, whatever the proposal q was,
provided q is the distribution that really produced each draft token. Terms
and the output contract are fixed once, in :class:`VerifyResult`.

All work is vectorised over the batch; only the row that needs a residual draw
is densified, and every probability comparison is done in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine import faults
from dspine.replica.sampling import sample

__all__ = ["PLACEHOLDER_TOKEN_ID", "VerifyResult", "verify_greedy", "verify_sampled"]

PLACEHOLDER_TOKEN_ID = -1  # pads output_ids after the last emitted token


@dataclass
class VerifyResult:
    """Outcome of verifying ``K`` draft tokens per request.

    The target scores ``[anchor, y_1 .. y_K]`` in one forward, giving its
    distribution ``p_t`` for every position ``t = 1 .. K + 1``.

    * **accepted** tokens: the longest prefix ``y_1 .. y_a`` of the draft that
      passes verification (greedy: ``y_t == argmax p_t``; sampled: coin
      ``u_t * q_t(y_t) < p_t(y_t)``, i.e. probability ``min(1, p_t(y_t) / q_t(y_t))``).
      ``a = accepted_len`` is in ``0 .. K``.
    * **recovered** token: when ``a < K``, the replacement for the first
      rejected draft token ``y_{a+1}``: greedy ``argmax p_{a+1}``; sampled a draw
      from ``norm([p_{a+1} - q_{a+1}]+)`` (the residual).
    * **bonus** token: when ``a == K``, the extra token after the whole draft:
      greedy ``argmax p_{K+1}``; sampled a draw from ``p_{K+1}``.

    Each request thus emits ``num_emitted = accepted_len + 1`` tokens: the
    accepted ones, then exactly one recovered or bonus token.

    Dynamic verification: request ``b`` may verify only its first
    ``K_b = num_verified[b] <= K`` draft tokens (a length chosen from draft-side
    information only, so the guarantee above holds unchanged). Everything
    above then reads with ``K_b`` in place of ``K``; the rows past ``K_b`` are
    padding and never read.

    Output contract (``B`` requests, ``K`` draft tokens each), field by field:
    """

    output_ids: torch.Tensor  # [B, K + 1] int32: accepted, then recovered/bonus, then PLACEHOLDER_TOKEN_ID
    accepted_len: torch.Tensor  # [B] int64, number of accepted draft tokens (0..K_b)
    num_emitted: torch.Tensor  # [B] int64, accepted_len + 1
    num_verified: torch.Tensor | None = None  # [B] int64 K_b, draft tokens verified (None: K for every request)

    @property
    def is_bonus(self) -> torch.Tensor:
        """[B] bool: the last emitted token is a bonus (the whole verified draft was accepted)."""
        if self.num_verified is not None:
            return self.accepted_len == self.num_verified
        return self.accepted_len == self.output_ids.shape[1] - 1

    @classmethod
    def make_empty(cls, num_draft_slots: int = 0, device: torch.device | str = "cpu") -> VerifyResult:
        """A zero-request result with ``K = num_draft_slots``, for tests and idle steps."""
        return cls(
            output_ids=torch.empty(0, num_draft_slots + 1, dtype=torch.int32, device=device),
            accepted_len=torch.empty(0, dtype=torch.int64, device=device),
            num_emitted=torch.empty(0, dtype=torch.int64, device=device),
        )


def _check_shapes(draft_ids: torch.Tensor, target: torch.Tensor, target_name: str) -> tuple[int, int, int]:
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids: expected shape [B, K], got {list(draft_ids.shape)}")
    b, k = draft_ids.shape
    if target.dim() != 3 or target.shape[0] != b or target.shape[1] != k + 1:
        raise ValueError(f"{target_name}: expected shape [{b}, {k + 1}, V] (B, K + 1, V), got {list(target.shape)}")
    if target.shape[2] == 0:
        raise ValueError(f"{target_name}: vocabulary dimension is empty")
    return b, k, target.shape[2]


def _check_num_verified(num_verified: torch.Tensor | None, b: int, k: int, device) -> torch.Tensor | None:
    if num_verified is None:
        return None
    num_verified = torch.as_tensor(num_verified, device=device).to(torch.int64)
    if num_verified.shape != (b,):
        raise ValueError(f"num_verified: expected shape [{b}], got {list(num_verified.shape)}")
    if b and (int(num_verified.min()) < 0 or int(num_verified.max()) > k):
        raise ValueError(f"num_verified: every entry must be in [0, {k}], got {num_verified.tolist()}")
    return num_verified


def _within_draft(accept: torch.Tensor, num_verified: torch.Tensor | None) -> torch.Tensor:
    """accept [B, K] with the positions past each request's K_b forced to False."""
    if num_verified is None:
        return accept
    return accept & (torch.arange(accept.shape[1], device=accept.device)[None, :] < num_verified[:, None])


def _assemble(draft_ids: torch.Tensor, accepted_len: torch.Tensor, final_ids: torch.Tensor,
              num_verified: torch.Tensor | None = None) -> VerifyResult:
    """Lay out [accepted draft tokens, final token, placeholders] as [B, K + 1] int32."""
    b, k = draft_ids.shape
    pos = torch.arange(k + 1, device=draft_ids.device)[None, :]  # [1, K+1]
    draft_padded = torch.cat([draft_ids.to(torch.int64), draft_ids.new_zeros(b, 1, dtype=torch.int64)], dim=1)
    acc = accepted_len[:, None]
    out = torch.where(pos < acc, draft_padded, torch.full_like(draft_padded, PLACEHOLDER_TOKEN_ID))
    out = torch.where(pos == acc, final_ids.to(torch.int64)[:, None], out)
    return VerifyResult(output_ids=out.to(torch.int32), accepted_len=accepted_len, num_emitted=accepted_len + 1,
                        num_verified=num_verified)


def _accepted_len(accept: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of ``accept [B, K]`` -> [B] int64."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor,
                  num_verified: torch.Tensor | None = None) -> VerifyResult:
    """Greedy verification: ``draft_ids [B, K]``, ``target_logits [B, K + 1, V]``,
    optional ``num_verified [B]`` (dynamic verification: only the first K_b draft tokens count).

    Accept the longest prefix where ``y_t == argmax`` of the target at position
    ``t`` (ties to the lower id), then emit the target's argmax at the first
    mismatch (recovered) or at row ``K_b`` (bonus).
    """
    b, k, _ = _check_shapes(draft_ids, target_logits, "target_logits")
    num_verified = _check_num_verified(num_verified, b, k, target_logits.device)
    target_ids = target_logits.argmax(dim=-1)  # [B, K+1]; first maximum = lower id
    accepted_len = _accepted_len(_within_draft(draft_ids.to(torch.int64) == target_ids[:, :k], num_verified))
    final_ids = target_ids.gather(1, accepted_len[:, None]).squeeze(1)
    return _assemble(draft_ids, accepted_len, final_ids, num_verified)


def verify_sampled(
    draft_ids: torch.Tensor,
    draft_q: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms_accept: torch.Tensor,
    uniforms_resample: torch.Tensor,
    *,
    draft_q_ids: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    num_verified: torch.Tensor | None = None,
) -> VerifyResult:
    """Speculative-sampling verification with pre-drawn coins (deterministic given them).

    Args:
        draft_ids: ``[B, K]`` int, the proposed tokens ``y_1 .. y_K``.
        draft_q: the proposal distribution that produced each ``y_t``, either
            DENSE ``[B, K, V]`` or SPARSE ``[B, K, C]`` values over the candidate
            ids ``draft_q_ids [B, K, C]`` (q is 0 off the candidates; candidate
            ids within a row should be distinct, duplicates add up). The drafter
            tail passes its ``q`` and ``cand_ids`` here.
        target_probs: ``[B, K + 1, V]`` target distributions p, built by
            :func:`dspine.replica.sampling.probabilities` with each request's
            own params (any float dtype; the gathered values are compared in float64).
        uniforms_accept: ``[B, K]`` coins in [0, 1) for the acceptance tests.
        uniforms_resample: ``[B]`` coin in [0, 1) for the single recovered or bonus draw.
        draft_q_ids: ``[B, K, C]`` int candidate ids; given iff ``draft_q`` is sparse.
        greedy: optional ``[B]`` bool; greedy rows use argmax semantics on
            ``target_probs`` (accept ``y_t == argmax p_t``, final token ``argmax``)
            and ignore q and the coins. Pass one-hot p (temperature 0) for them.
        num_verified: optional ``[B]`` int, dynamic verification: request ``b`` verifies only
            ``y_1 .. y_{K_b}``; if all of those pass, its bonus is drawn from ``p_{K_b + 1}``.

    Sampled rows: accept ``y_t`` iff ``u_t * q_t(y_t) < p_t(y_t)`` (acceptance
    probability ``min(1, p/q)`` without dividing; ``q_t(y_t) == 0`` accepts iff
    ``p_t(y_t) > 0``). At the first rejection draw the recovered token from
    ``[p - q]+`` (normalised inside :func:`sample`); if all pass, draw the bonus
    from ``p_{K+1}``.

    Degenerate residual: a rejection needs ``p(y) < q(y)``, so with exactly
    normalised p and q the residual has positive mass. Only rounding (p and q
    equal up to their last bits, where the acceptance probability is 1 up to
    rounding) can leave ``sum [p - q]+ == 0``; the recovered token is then drawn
    from ``p`` itself, the limit of the residual as ``q -> p``.

    Sparse and dense q give bit-identical results for the same p and coins: both
    paths gather the same float64 ``q(y_t)`` and build the same dense residual row.
    """
    b, k, v = _check_shapes(draft_ids, target_probs, "target_probs")
    dev = target_probs.device
    if uniforms_accept.shape != (b, k):
        raise ValueError(f"uniforms_accept: expected shape [{b}, {k}], got {list(uniforms_accept.shape)}")
    if uniforms_resample.shape != (b,):
        raise ValueError(f"uniforms_resample: expected shape [{b}], got {list(uniforms_resample.shape)}")
    sparse = draft_q_ids is not None
    if sparse:
        if draft_q.dim() != 3 or draft_q.shape[:2] != (b, k) or draft_q_ids.shape != draft_q.shape:
            raise ValueError(
                f"draft_q / draft_q_ids: sparse q needs matching shapes [{b}, {k}, C], "
                f"got {list(draft_q.shape)} and {list(draft_q_ids.shape)}"
            )
    elif draft_q.shape != (b, k, v):
        raise ValueError(
            f"draft_q: dense q needs shape [{b}, {k}, {v}] (pass draft_q_ids for sparse q), got {list(draft_q.shape)}"
        )
    if greedy is not None and greedy.shape != (b,):
        raise ValueError(f"greedy: expected shape [{b}], got {list(greedy.shape)}")
    num_verified = _check_num_verified(num_verified, b, k, dev)

    f64 = torch.float64
    y = draft_ids.to(torch.int64)  # [B, K]

    # Acceptance tests at every position (only the prefix up to the first failure matters).
    p_y = target_probs[:, :k].gather(2, y[:, :, None]).squeeze(2).to(f64)  # [B, K]
    if sparse:
        q_y = torch.where(draft_q_ids.to(torch.int64) == y[:, :, None], draft_q.to(f64), 0.0).sum(dim=2)
    else:
        q_y = draft_q.gather(2, y[:, :, None]).squeeze(2).to(f64)  # [B, K]
    accept = uniforms_accept.to(f64) * q_y < p_y  # [B, K]
    if faults.active("verify.always_accept"):
        accept = torch.ones_like(accept)

    if greedy is not None:
        target_ids = target_probs.argmax(dim=-1)  # [B, K+1], ties to the lower id
        accept = torch.where(greedy[:, None], y == target_ids[:, :k], accept)
    accepted_len = _accepted_len(_within_draft(accept, num_verified))  # [B]

    # One dense distribution per row: residual [p - q]+ at the first rejection,
    # p itself at row K (bonus). q is zero for bonus rows.
    p_row = target_probs.gather(1, accepted_len[:, None, None].expand(b, 1, v)).squeeze(1).to(f64)  # [B, V]
    if k > 0:
        t_star = accepted_len.clamp(max=k - 1)
        truncated_bonus_is_rejection = faults.active("verify.bonus_from_residual")
        rejected = (accepted_len < (k if num_verified is None or truncated_bonus_is_rejection else num_verified))[:, None]
        if sparse:
            c = draft_q.shape[2]
            q_vals = draft_q.gather(1, t_star[:, None, None].expand(b, 1, c)).squeeze(1).to(f64)
            q_ids = draft_q_ids.gather(1, t_star[:, None, None].expand(b, 1, c)).squeeze(1).to(torch.int64)
            q_row = torch.zeros(b, v, dtype=f64, device=dev).scatter_add_(1, q_ids, q_vals)
        else:
            q_row = draft_q.gather(1, t_star[:, None, None].expand(b, 1, v)).squeeze(1).to(f64)
        q_row = torch.where(rejected, q_row, 0.0)
        if faults.active("verify.recover_from_p"):
            q_row = torch.zeros_like(q_row)
        dist = (p_row - q_row).clamp_(min=0.0)
        degenerate = (dist.sum(dim=1) <= 0)[:, None]
        dist = torch.where(degenerate, p_row, dist)
    else:
        dist = p_row
    final_ids = sample(dist, uniforms_resample.to(f64))

    if greedy is not None:
        greedy_final = target_ids.gather(1, accepted_len[:, None]).squeeze(1)
        final_ids = torch.where(greedy, greedy_final, final_ids)
    return _assemble(draft_ids, accepted_len, final_ids, num_verified)
