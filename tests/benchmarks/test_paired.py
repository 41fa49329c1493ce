"""Paired bench runs: the pooled ratio and its bootstrap interval (``dspine.benchmarks.paired``)."""

from __future__ import annotations

import math
import random

import pytest

from dspine import faults
from dspine.benchmarks.paired import Pair, bootstrap_interval, floor_verdict, pooled_ratio

pytestmark = pytest.mark.timeout(60)


def drifting_pairs(rng: random.Random, num_pairs: int, ratio: float, drift: float = 0.15,
                   noise: float = 0.03) -> list[Pair]:
    """Pairs on a machine whose speed drifts by ``drift`` (log scale) from pair to pair, both sides of
    a pair sharing it, each side with ``noise`` of its own; speculative runs ``ratio`` times faster."""
    pairs = []
    for _ in range(num_pairs):
        machine = math.exp(rng.gauss(0.0, drift))
        target_only = 2.0 * machine * math.exp(rng.gauss(0.0, noise))
        speculative = 2.0 / ratio * machine * math.exp(rng.gauss(0.0, noise))
        pairs.append(Pair(target_only, speculative, 1024, 1024))
    return pairs


def test_a_pairs_ratio_is_tokens_per_second_on_each_side():
    pair = Pair(target_only_seconds=2.0, speculative_seconds=1.0, target_only_tokens=100, speculative_tokens=80)
    assert pair.ratio == pytest.approx((80 / 1.0) / (100 / 2.0))
    # pooled: a long pair weighs by its seconds, not as one vote among pairs
    pairs = [Pair(1.0, 0.5, 100, 100), Pair(9.0, 9.0, 900, 900)]
    assert pooled_ratio(pairs) == pytest.approx((1000 / 9.5) / (1000 / 10.0))


def test_the_interval_holds_the_pooled_ratio_and_one_pair_is_its_own_interval():
    pairs = drifting_pairs(random.Random(3), 24, 0.97)
    low, high = bootstrap_interval(pairs)
    assert low < pooled_ratio(pairs) < high
    assert bootstrap_interval(pairs, seed=5) != (low, high)  # resampled, not read off the data
    assert bootstrap_interval(pairs) == (low, high)  # and reproducible by its seed
    assert bootstrap_interval(pairs[:1]) == (pytest.approx(pairs[0].ratio), pytest.approx(pairs[0].ratio))


def test_the_interval_covers_the_true_ratio_about_as_often_as_it_claims():
    """100 simulated cells of 36 pairs (a 9-repeat sweep's 8-in-flight cell) on a machine drifting by
    15% between pairs: the 95% interval holds the true ratio in 85-99% of them, and is about as narrow
    as the pairs' own noise allows (not the drift's). Resampling the two sides apart (the fault
    ``bench.bootstrap_unpaired``) puts the drift back: intervals about five times wider that hold the
    truth every time."""
    true_ratio, noise, num_pairs = 0.97, 0.03, 36
    # the pooled ratio's standard error from each side's own noise alone, and the width it allows
    standard_error = true_ratio * noise * math.sqrt(2.0 / num_pairs)
    allowed_width = 2 * 1.96 * standard_error * 1.5

    def simulate() -> tuple[float, float]:
        rng = random.Random(11)
        covered, widths = 0, []
        for cell in range(100):
            low, high = bootstrap_interval(drifting_pairs(rng, num_pairs, true_ratio, noise=noise), resamples=400,
                                           seed=cell)
            covered += low <= true_ratio <= high
            widths.append(high - low)
        return covered / 100, sum(widths) / len(widths)

    coverage, width = simulate()
    assert 0.85 <= coverage <= 0.99, coverage
    assert width < allowed_width, (width, allowed_width)
    with faults.inject("bench.bootstrap_unpaired"):
        coverage, width = simulate()
    assert not (0.85 <= coverage <= 0.99 and width < allowed_width), (coverage, width)


def test_the_floor_verdict_reads_the_whole_interval():
    assert floor_verdict((0.90, 0.96), 0.97) == "below"
    assert floor_verdict((0.97, 1.10), 0.97) == "above"
    assert floor_verdict((0.95, 0.99), 0.97) == "undecided"


@pytest.mark.parametrize("kwargs, field", [({"confidence": 1.0}, "confidence"), ({"resamples": 0}, "resamples")])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        bootstrap_interval([Pair(1.0, 1.0, 1, 1)], **kwargs)
    with pytest.raises(ValueError, match="pairs"):
        bootstrap_interval([])
