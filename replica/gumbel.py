"""Seed-reproducible sampling: Gumbel-max with noise keyed by (seed, position, token id).

The Gumbel-max trick: if ``g_v`` are i.i.d. standard Gumbel, ``argmax_v(log
p_v + g_v)`` is distributed as ``p``. Here ``g`` is not read from a stream but
computed by a counter-based hash of ``(seed, absolute position, token id)``, so
the token at a position depends on the request's seed, its context and
nothing else: not on its batch, on how many coins earlier steps consumed, or
on whether the position was drafted. ``log p`` is the target's filtered
logits (after penalties, temperature, min-p, top-k, top-p; dropped tokens at
``-inf`` never win).

Under speculation the drafter proposes with the same noise over its
candidates (:func:`gumbel_chain`), and verification is an exact match:
draft token ``y_t`` is accepted iff it equals the target's Gumbel-argmax at
that position; the first mismatch emits the target's Gumbel-argmax. The
output is therefore token-for-token the target-only output, and each token is
distributed as the target's sampling distribution (the noise at different
positions is independent, and the position's context never depends on that
position's noise).

The hash (32-bit integer mixing, products kept below 2**63 so int64 never
overflows) is the same on every device; the uniform has 53 bits.
"""

from __future__ import annotations

import math

import torch

from dspine import faults

__all__ = ["seed_words", "gumbel_noise", "gumbel_scores", "gumbel_argmax", "gumbel_chain"]

_M32 = 0xFFFFFFFF
_MUL = 0x045D9F3B  # < 2**27: x * _MUL < 2**59 for 32-bit x
_SALT = (0x2545F491, 0x9E3779B9, 0x7F4A7C15)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (values in [0, 2**32) held in int64)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def seed_words(seed: int) -> tuple[int, int]:
    """The two 32-bit halves of a seed in [0, 2**64) (int64 cannot hold the upper half's sign bit)."""
    return seed & _M32, (seed >> 32) & _M32


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``[N, C]`` float64 for ``token_ids [N, C]`` at ``positions [N]`` of
    requests with ``seeds [N, 2]`` (int64 32-bit words from :func:`seed_words`)."""
    # seeds: [N, 2]; positions: [N]; token_ids: [N, C]
    lo, hi = seeds[:, 0:1].to(torch.int64), seeds[:, 1:2].to(torch.int64)
    pos = positions.to(torch.int64)[:, None] & _M32
    key = _mix32(lo ^ _mix32(hi ^ _SALT[0]))  # [N, 1]
    key = _mix32(key ^ _mix32(pos ^ _SALT[1]))
    ids = token_ids.to(torch.int64) & _M32
    h1 = _mix32(key ^ _mix32(ids))  # [N, C]
    h2 = _mix32(h1 ^ _SALT[2])
    u = ((h1 << 21) + (h2 >> 11)).to(torch.float64).add_(0.5).mul_(2.0 ** -53)  # (0, 1)
    g = -torch.log(-torch.log(u))
    if faults.active("gumbel.noise_halved"):
        g = g * 0.5
    return g


def gumbel_argmax(filtered_logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``ids [N]`` int64: ``argmax(filtered_logits [N, V] + g(seed, position, v))`` (``-inf`` never wins)."""
    n, v = filtered_logits.shape
    ids = torch.arange(v, device=filtered_logits.device).expand(n, v)
    return gumbel_scores(filtered_logits, seeds, positions, ids).argmax(dim=-1)


def gumbel_scores(filtered_logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  token_ids: torch.Tensor) -> torch.Tensor:
    """``filtered_logits [N, C] + g [N, C]`` in float64, ``-inf`` kept at dropped entries."""
    noise = gumbel_noise(seeds, positions, token_ids)
    x = filtered_logits.to(torch.float64)
    return torch.where(torch.isfinite(x), x + noise, -math.inf)


def gumbel_chain(scores: torch.Tensor, cand_ids: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seeds: torch.Tensor, first_positions: torch.Tensor):
    """The drafter's proposal in Gumbel mode: the serial walk over its conditional tables, each row
    the Gumbel-argmax (same noise as the target's, keyed by the candidate ids) of its filtered
    candidate logits. Returns ``(draft_ids [NB, T], choice [NB, T], q [NB, T, K])``, q one-hot at the
    choice (the proposal is deterministic given the noise).

    ``scores [NB, T, K(j), K(i)]``, ``cand_ids [NB, T, K]``, per-block ``temperature``/``top_k``/``top_p
    [NB]``, ``seeds [NB, 2]``, ``first_positions [NB]`` the absolute position of ``y_1``."""
    from .sampling import filter_logits

    nb, t, k, _ = scores.shape
    dev = scores.device
    j = torch.zeros(nb, dtype=torch.int64, device=dev)
    rows = torch.arange(nb, device=dev)
    choices = []
    for row in range(t):
        logits = scores[rows, row, j]  # [NB, K] receiver logits given predecessor slot j
        filtered = filter_logits(logits.to(torch.float64), temperature, top_k, top_p)
        j = gumbel_scores(filtered, seeds, first_positions + row, cand_ids[:, row]).argmax(dim=-1)
        choices.append(j)
    choice = torch.stack(choices, dim=1) if choices else torch.zeros(nb, 0, dtype=torch.int64, device=dev)
    draft_ids = cand_ids.gather(2, choice[..., None])[..., 0]
    q = torch.zeros(nb, t, k, dtype=torch.float64, device=dev).scatter_(2, choice[..., None], 1.0)
    return draft_ids, choice, q
