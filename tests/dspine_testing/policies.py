"""Speculation policies whose costs a test sets, not the machine it runs on."""

from __future__ import annotations

from dspine.replica.speculation_policy import SpeculationPolicy


def policy_with_costs(rows: int, forward=(0.004, 0.0003), overhead=(0.002, 0.001)) -> SpeculationPolicy:
    """A policy of ``rows`` draft rows that has measured a target and a verify forward of
    ``forward`` (intercept, seconds per row) and drafter passes of ``overhead`` (intercept, seconds
    per request drafting a whole block: a line in drafted rows). Each point is measured twice, so
    every line is settled (``LinearCost.settled``): an unsettled line's
    probes are made whatever they cost, and these policies price what the test sets."""
    policy = SpeculationPolicy(rows)
    for num_rows in (1, 8, 16, 30) * 2:
        policy.costs.target_forward.observe(num_rows, forward[0] + forward[1] * num_rows)
        policy.costs.verify_forward.observe(num_rows, forward[0] + forward[1] * num_rows)
        requests = num_rows % 8 + 1
        policy.costs.draft_overhead.observe(requests * (rows + 1), overhead[0] + overhead[1] * requests)
    return policy
