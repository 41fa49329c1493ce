"""Per-token log-probabilities returned to callers who ask (``SamplingParams.logprobs = n``).

Which distribution: ``log_softmax(x / T)`` of the target's logits ``x`` *after*
the request's logit bias and penalties (:mod:`dspine.replica.logits_processors`)
and its temperature ``T`` (``T = 1`` for greedy requests), *before* the
truncating filters (min-p, top-k, top-p). Truncation would make every dropped
alternative ``-inf`` and a greedy request's distribution one-hot (all 0), so
the untruncated values are the informative ones (vLLM's "processed logprobs"
without truncation). The same computation serves target-only steps and every
row of a verified block, so the values agree with speculation on and off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import SamplingParams

__all__ = ["TokenLogprobs", "compute"]


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprob and the request's top-n alternatives (descending, ties to lower id)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), n entries


def compute(logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: torch.Tensor) -> list[TokenLogprobs]:
    """``logits [N, V]`` (after penalties / bias), one request's params per row, ``token_ids [N]`` chosen."""
    # logits: [N, V]; token_ids: [N]
    temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                               dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)  # [N, V]
    chosen = logp.gather(1, token_ids.to(torch.int64)[:, None])[:, 0].tolist()
    n_max = max((p.logprobs or 0) for p in params)
    top_vals, top_ids = (logp.topk(n_max, dim=-1, sorted=True) if n_max else (None, None))
    out = []
    for i, p in enumerate(params):
        n = p.logprobs or 0
        top = tuple(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())) if n else ()
        out.append(TokenLogprobs(int(token_ids[i]), chosen[i], top))
    return out
