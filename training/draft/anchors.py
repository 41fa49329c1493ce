"""Where the training blocks start: anchors drawn per sequence from a seeded generator."""

from __future__ import annotations

import torch


def _uniform(lo: torch.Tensor, hi: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """[B, n] integers uniform in [lo, hi] (inclusive, per row)."""
    span = (hi - lo + 1).clamp(min=1)
    u = torch.rand(len(lo), n, generator=generator)
    return lo[:, None] + (u * span[:, None]).long().clamp(max=span[:, None] - 1)


def sample_anchors(prompt_len: torch.Tensor, seq_len: int, block_size: int, per_seq: int,
                   generator: torch.Generator, early_frac: float = 0.0, early_span: int = 32,
                   text_anchors: bool = False) -> torch.Tensor:
    """[B, per_seq] anchors. ``round(early_frac * per_seq)`` of them uniform in the first ``early_span``
    positions of the continuation [P - 1, P - 2 + early_span] (where speculative decoding spends most of
    its cycles), the rest uniform over the continuation [P - 1, seq_len - block_size] (all labels are
    target output), or with ``text_anchors`` over the whole sequence [1, seq_len - block_size] (prompt
    text included, see ``block_labels``). With the defaults this draws exactly one ``[B, per_seq]``
    uniform tensor from ``generator``, as the recipe of the shipped drafter did."""
    hi = torch.full_like(prompt_len, seq_len - block_size)
    n_early = int(round(early_frac * per_seq))
    lo_cont = (prompt_len - 1).clamp(min=1).minimum(hi)
    parts = []
    if n_early:
        parts.append(_uniform(lo_cont, (lo_cont + early_span - 1).minimum(hi), n_early, generator))
    lo_rest = torch.ones_like(prompt_len).minimum(hi) if text_anchors else lo_cont
    parts.append(_uniform(lo_rest, hi, per_seq - n_early, generator))
    return torch.cat(parts, dim=1)

