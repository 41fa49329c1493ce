"""Penalties and logit bias: the one place a request's raw target logits are adjusted.

Every path that turns target logits into a token runs them through
:func:`process` first: prefill's first token and target-only steps
(``[N, 1, V]``) as well as speculative verification (``[NB, T, V]``), so "the
target's distribution" is the same function of the context whether or not a
block was drafted. The order (as vLLM's v1 sampler) is:

1. **logit bias**: ``logits[v] += bias[v]`` (:class:`LogitBias`);
2. **repetition penalty** ``r`` (CTRL / HF / vLLM): every token seen in the
   prompt or the output: ``logit / r`` if ``logit > 0`` else ``logit * r``;
3. **presence / frequency penalties** (OpenAI / vLLM): ``logit -= presence *
   [count > 0] + frequency * count``, counting the *output* tokens only.

Then :mod:`dspine.replica.sampling` applies temperature, min-p, top-k, top-p.

Inside a verified block, row ``t`` (the logits after ``y_t``; row 0 is after
the anchor) predicts the token after ``anchor, y_1 .. y_t``, so its counts are
the context's counts plus ``y_1 .. y_t``: :func:`process` builds them as a
cumulative sum over the block (``[NB, T, V]``). One count vector for every row
(fault ``penalties.same_counts_for_every_row``) is the usual speculative-engine
bug: row 5 would not see the tokens drafted at rows 1-4.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspine import faults

from .sampling import SamplingParams

__all__ = ["Penalties", "LogitBias", "ContextCounts", "needs_processing", "context_counts", "process"]


@dataclass(frozen=True)
class Penalties:
    """The three penalties of one request (neutral values: 1, 0, 0)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0

    @classmethod
    def of(cls, params: SamplingParams) -> "Penalties":
        return cls(params.repetition_penalty, params.presence_penalty, params.frequency_penalty)

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0


@dataclass(frozen=True)
class LogitBias:
    """Sparse additive bias of one request: ``(token id, bias)`` pairs."""

    pairs: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, params: SamplingParams) -> "LogitBias":
        return cls(params.logit_bias)

    @property
    def active(self) -> bool:
        return bool(self.pairs)


def needs_processing(params: Sequence[SamplingParams]) -> bool:
    """True when some request of the batch has a penalty or a logit bias (else logits pass untouched)."""
    return any(Penalties.of(p).active or LogitBias.of(p).active for p in params)


@dataclass
class ContextCounts:
    """What the penalties read about each request's context before the current position."""

    seen: torch.Tensor  # [B, V] bool: token occurs in prompt or output (repetition penalty)
    output_counts: torch.Tensor  # [B, V] float32: occurrences in the output (presence / frequency)


def context_counts(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], vocab: int,
                   device: torch.device | str) -> ContextCounts:
    """Counts of ``B`` contexts (prompt ids and output ids so far, the pending token included)."""
    b = len(prompts)
    output_counts = torch.zeros(b, vocab, dtype=torch.float32, device=device)
    seen = torch.zeros(b, vocab, dtype=torch.bool, device=device)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        if output:
            ids = torch.as_tensor(list(output), dtype=torch.int64, device=device)
            output_counts[i].index_add_(0, ids, torch.ones(len(ids), dtype=torch.float32, device=device))
        if prompt:
            seen[i, torch.as_tensor(list(prompt), dtype=torch.int64, device=device)] = True
    return ContextCounts(seen | (output_counts > 0), output_counts)


def _row_tensors(params: Sequence[SamplingParams], vocab: int, device):
    penalties = [Penalties.of(p) for p in params]
    rep = torch.tensor([x.repetition for x in penalties], dtype=torch.float32, device=device)
    presence = torch.tensor([x.presence for x in penalties], dtype=torch.float32, device=device)
    frequency = torch.tensor([x.frequency for x in penalties], dtype=torch.float32, device=device)
    bias = torch.zeros(len(params), vocab, dtype=torch.float32, device=device)
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=device)
            bias[i, ids] = torch.tensor([v for _, v in p.logit_bias], dtype=torch.float32, device=device)
    return rep, presence, frequency, bias


def process(logits: torch.Tensor, params: Sequence[SamplingParams], counts: ContextCounts,
            block_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Apply each request's logit bias and penalties: ``logits [B, T, V] -> [B, T, V]`` (float32 or wider).

    ``counts`` describe each context before row 0; ``block_ids [B, T - 1]`` (the drafted
    ``y_1 .. y_{T-1}``, None when ``T == 1``) are added for the rows after them: row ``t``
    counts ``y_1 .. y_t``. Rows past a request's verified length see padding ids; their
    logits are never read.
    """
    # logits: [B, T, V]; counts.seen / output_counts: [B, V]; block_ids: [B, T-1]
    b, t, v = logits.shape
    dev = logits.device
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    rep, presence, frequency, bias = _row_tensors(params, v, dev)
    row_counts = counts.output_counts[:, None, :].expand(b, t, v)  # [B, T, V]
    if t > 1 and block_ids is not None and not faults.active("penalties.same_counts_for_every_row"):
        drafted = torch.zeros(b, t - 1, v, dtype=torch.float32, device=dev)
        drafted.scatter_(2, block_ids[:, : t - 1].to(torch.int64).clamp(0, v - 1)[:, :, None], 1.0)
        before_row = torch.cat([torch.zeros(b, 1, v, dtype=torch.float32, device=dev), drafted.cumsum(dim=1)], dim=1)
        row_counts = row_counts + before_row
    seen = counts.seen[:, None, :] | (row_counts > 0)  # [B, T, V]

    x = x + bias[:, None, :].to(x.dtype)
    r = rep[:, None, None].to(x.dtype)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - presence[:, None, None].to(x.dtype) * (row_counts > 0).to(x.dtype)
    x = x - frequency[:, None, None].to(x.dtype) * row_counts.to(x.dtype)
    return x
