"""Paired measurements of target-only and speculative decoding: each pair's ratio, and an interval.

A pair is the same work (the same prompts, the same number of new tokens) decoded once
target-only and once speculatively, the two adjacent in time, so that a slow stretch of a
shared machine lands on both sides. The benches report the median over repeats of the paired
ratio; its lowest and highest show the spread but say nothing of how far the median itself may
be from the truth. On the 2-core CPU the same target-only work varies by up to 1.35x from one
run to the next, so a regime within a few points of 1 cannot be read from a median of three.

:func:`bootstrap_interval` gives that distance: a percentile bootstrap over the pairs of the
pooled ratio (every pair's tokens over every pair's seconds, on each side). Pairs are resampled
whole: resampling the two sides apart would add the machine's drift, which the pairing removes,
back into the interval. The interval assumes pairs are exchangeable; drift within a pair (one
side ran in a slow second) is what it measures, drift slower than a pair is what pairing
cancels.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from dspine import faults

__all__ = ["Pair", "pooled_ratio", "bootstrap_interval", "floor_verdict"]

# Resamples of the bootstrap: 2,000 puts a 95% interval's ends within about 0.002 of their limit
# for the 20-80 pairs a sweep cell holds, in tens of milliseconds.
_RESAMPLES = 2000


@dataclass(frozen=True)
class Pair:
    """One paired run: both modes' wall seconds and the tokens they emitted."""

    target_only_seconds: float
    speculative_seconds: float
    target_only_tokens: int
    speculative_tokens: int

    @property
    def ratio(self) -> float:
        """Speculative over target-only tokens per second."""
        return (self.speculative_tokens / self.speculative_seconds) / (self.target_only_tokens
                                                                        / self.target_only_seconds)


def pooled_ratio(pairs: Sequence[Pair]) -> float:
    """Speculative over target-only tokens per second of all ``pairs`` together (the work of all of
    them on each side: a long pair weighs as much as its seconds)."""
    if not pairs:
        raise ValueError("pairs: at least one pair is needed")
    target_only = sum(p.target_only_tokens for p in pairs) / sum(p.target_only_seconds for p in pairs)
    speculative = sum(p.speculative_tokens for p in pairs) / sum(p.speculative_seconds for p in pairs)
    return speculative / target_only


def bootstrap_interval(pairs: Sequence[Pair], confidence: float = 0.95, resamples: int = _RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """The ``confidence`` percentile-bootstrap interval of :func:`pooled_ratio` over ``pairs``
    (resampled whole, with replacement; ``seed`` makes it reproducible). One pair gives its own
    ratio at both ends: one pair says nothing of its scatter."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples: must be >= 1, got {resamples}")
    if not pairs:
        raise ValueError("pairs: at least one pair is needed")
    rng = random.Random(seed)
    n = len(pairs)
    unpaired = faults.active("bench.bootstrap_unpaired")
    statistics = []
    for _ in range(resamples):
        picks = [pairs[rng.randrange(n)] for _ in range(n)]
        if unpaired:  # the fault: each side drawn on its own, as if the two modes ran at unrelated times
            others = [pairs[rng.randrange(n)] for _ in range(n)]
            target_only = sum(p.target_only_tokens for p in picks) / sum(p.target_only_seconds for p in picks)
            speculative = sum(p.speculative_tokens for p in others) / sum(p.speculative_seconds for p in others)
            statistics.append(speculative / target_only)
        else:
            statistics.append(pooled_ratio(picks))
    statistics.sort()
    tail = (1.0 - confidence) / 2.0
    low = statistics[min(resamples - 1, int(tail * resamples))]
    high = statistics[max(0, min(resamples - 1, int((1.0 - tail) * resamples) - 1))]
    return low, high


def floor_verdict(interval: tuple[float, float], floor: float) -> str:
    """Where an interval puts a ratio against ``floor``: "below" (the whole interval is under it),
    "above" (at or over it) or "undecided" (the interval straddles it)."""
    low, high = interval
    if high < floor:
        return "below"
    if low >= floor:
        return "above"
    return "undecided"
