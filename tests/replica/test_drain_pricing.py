"""Drain pricing: where freed slots stay empty, a token is worth what it saves of the batch's
remaining decode time (replica/drain_pricing.py), counted on the policy's choices, not timed."""

from __future__ import annotations

import random

import pytest

from dspine import faults
from dspine.replica.drain_pricing import FULL, drain_pricing, shortest_runs
from dspine.replica.speculation_policy import SpeculationPolicy
from dspine_testing.policies import policy_with_costs

pytestmark = pytest.mark.timeout(60)

ROWS = 15
# A 2-core CPU's shape: a target step's fixed cost is most of it (7 ms + 0.6 ms a request)
TARGET_LINE = (0.007, 0.0006)


def _policy(forward=TARGET_LINE, overhead=(0.002, 0.001)) -> SpeculationPolicy:
    """``overhead``: (intercept, seconds per request drafting a whole block), a line in drafted rows."""
    return policy_with_costs(ROWS, forward, overhead)


def test_the_shortest_run_is_the_product_of_the_requests_chances_row_by_row():
    one, two = [0.9, 0.81, 0.5], [0.5, 0.25]
    assert shortest_runs([one], 3) == pytest.approx([0.9, 0.9 + 0.81, sum(one)])
    assert shortest_runs([one, two], 3)[-1] == pytest.approx(0.9 * 0.5 + 0.81 * 0.25)  # two has no row 3
    # against a simulation of two requests accepting independently
    rng = random.Random(0)
    conditionals = [[0.9, 0.9, 0.6], [0.5, 0.5]]

    def accepted(c):
        n = 0
        while n < len(c) and rng.random() < c[n]:
            n += 1
        return n

    trials = 40000
    mean_min = sum(min(accepted(conditionals[0]), accepted(conditionals[1])) for _ in range(trials)) / trials
    gains = [[0.9, 0.81, 0.486], [0.5, 0.25]]
    assert mean_min == pytest.approx(shortest_runs(gains, 3)[-1], abs=0.02)


def test_pricing_at_one_request_or_a_refilled_replica_counts_every_token_in_full():
    assert drain_pricing({"a": 50}, ["a"], 0.0, TARGET_LINE) == FULL
    assert drain_pricing({"a": 50, "b": 10}, ["a", "b"], 1.0, TARGET_LINE) == FULL
    assert drain_pricing(None, ["a"], 0.0, TARGET_LINE) == FULL


def test_pricing_of_a_drained_batch_splits_a_step_into_its_fixed_and_per_request_parts():
    intercept, slope = TARGET_LINE
    remaining = {"a": 90, "b": 90, "c": 20, "d": 5}
    step = intercept + slope * 4
    pricing = drain_pricing(remaining, ["a", "b", "c"], 0.0, TARGET_LINE)
    assert pricing.token_value == pytest.approx(slope * 4 / step)
    assert pricing.lead_token_value == pytest.approx(intercept * 4 / step)
    assert pricing.critical == {"a", "b"} and pricing.lead == 70
    half = drain_pricing(remaining, ["a", "b", "c"], 0.5, TARGET_LINE)
    assert half.token_value == pytest.approx(0.5 + 0.5 * slope * 4 / step)
    # the longest request cannot draft (target-only): nothing shortens the batch's end
    assert drain_pricing(remaining, ["b", "c"], 0.0, TARGET_LINE).critical == frozenset()


def _closed_group_plan(refill_share: float):
    """8 requests with equal remaining output: 2 accept every row, 6 none."""
    policy = _policy()
    good, bad = ["good0", "good1"], [f"bad{i}" for i in range(6)]
    for _ in range(10):
        for r in good:
            policy.observe_cycle(r, ROWS, ROWS)
        for r in bad:
            policy.observe_cycle(r, ROWS, 0)
    candidates = {r: ROWS for r in good + bad}
    return policy.plan(candidates, remaining={r: 100 for r in candidates}, refill_share=refill_share)


def test_a_closed_group_does_not_draft_a_subset_that_pays_only_under_load():
    """The two good requests' whole blocks pay where their slots go to the next requests; in a group
    nobody refills they would finish early and leave the six to a thinner, dearer batch."""
    assert set(_closed_group_plan(1.0).draft_rows) == {"good0", "good1"}
    drained = _closed_group_plan(0.0)
    assert drained.draft_rows == {} and not drained.is_probe
    with faults.inject("policy.drain_unpriced"):
        assert set(_closed_group_plan(0.0).draft_rows) == {"good0", "good1"}


def _laggard_plan(refill_share: float):
    """7 requests near their end that accept nothing, one far behind that accepts 5 rows a cycle."""
    policy = _policy()
    others = [f"done{i}" for i in range(7)]
    for _ in range(10):
        policy.observe_cycle("laggard", ROWS, 5)
        for r in others:
            policy.observe_cycle(r, ROWS, 0)
    candidates = {r: ROWS for r in others + ["laggard"]}
    remaining = {r: 10 for r in others} | {"laggard": 100}
    return policy.plan(candidates, remaining=remaining, refill_share=refill_share)


def test_a_lone_laggard_drafts_where_a_loaded_replica_would_not():
    """Five tokens a cycle do not pay for a drafter pass beside seven target-only requests when each
    token is worth an eighth of a step; when the laggard sets the batch's end each of its tokens
    saves a whole step's fixed cost."""
    assert _laggard_plan(1.0).draft_rows == {}
    rows = _laggard_plan(0.0).draft_rows
    assert list(rows) == ["laggard"] and 1 <= rows["laggard"] <= ROWS
    with faults.inject("policy.drain_unpriced"):
        assert _laggard_plan(0.0).draft_rows == {}


def test_pruned_and_unpruned_drain_priced_plans_agree():
    """The pruning bound stays sound with drain pricing (lead values above a full token)."""
    rng = random.Random(3)
    for trial in range(60):
        policy = _policy(overhead=(0.002, rng.choice([0.0005, 0.001, 0.003])))
        ids = [f"r{i}" for i in range(rng.randint(2, 8))]
        for r in ids:
            accepted = rng.randint(0, ROWS)
            for _ in range(rng.randint(1, 6)):
                policy.observe_cycle(r, ROWS, accepted)
        candidates = {r: rng.randint(1, ROWS) for r in ids}
        remaining = {r: rng.choice([40, 40, 60, 100]) for r in ids}
        share = rng.choice([0.0, 0.3, 0.9])
        kwargs = dict(remaining=remaining, refill_share=share)
        pruned = policy._best_rows(candidates, 0, **kwargs)
        assert pruned == policy._best_rows(candidates, 0, prune=False, **kwargs), trial


def _probes_in_closed_group(refill_share: float, steps: int = 300) -> int:
    """Probes among ``steps`` steps of 8 greedy requests with equal remaining output whose drafts
    all fail."""
    policy = _policy()
    losing = {f"bad{i}": ROWS for i in range(8)}
    for request_id in losing:
        for _ in range(10):
            policy.observe_cycle(request_id, ROWS, 0)
    probes = 0
    for step in range(steps):
        plan = policy.plan(losing, remaining={r: 500 - step for r in losing}, refill_share=refill_share)
        probes += plan.is_probe
        for request_id, rows in plan.draft_rows.items():
            policy.observe_cycle(request_id, rows, 0)
    return probes


def test_a_closed_group_makes_no_probe_that_could_not_pay_even_if_it_hit():
    """A probe drafts 2 of the 8: in a group nobody refills, even a cycle that accepted every row
    would only let those two run ahead, worth less than its cost, so none is made; under load the
    same steps probe on their back-off schedule."""
    assert _probes_in_closed_group(0.0) == 0
    assert _probes_in_closed_group(1.0) >= 3
    with faults.inject("policy.drain_unpriced"):
        assert _probes_in_closed_group(0.0) >= 3
