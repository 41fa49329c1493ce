"""What an accepted draft token is worth to a batch whose freed slots stay empty.

A replica under load turns every accepted token into throughput: the slot its request frees early
goes to the next request. A batch that nobody refills (a closed group, the end of a load) drains at
the pace of its longest request instead. With a target-only step costing ``F + m * b`` seconds for
``b`` requests, the rest of the batch costs about ``F * max(n) + m * sum(n)`` seconds (``n``: each
request's remaining output tokens), so a token accepted for a request saves ``m`` seconds, and only
tokens that shorten the longest remaining output also save ``F`` each. On a 2-core CPU ``F`` is most
of a step (7.1 of 12.1 ms at eight requests): a request that ran ahead left the others 571 steps of
a thinner batch in the sweep's closed groups of 8, 3.67 s of a 4.9 s loss.

The plan counts a step's tokens in target-only tokens of its batch (``S0 / b`` seconds each, ``S0``
the target-only step): with ``p`` the share of freed slots that are refilled
(:class:`~dspine.replica.slot_refills.SlotRefills`), an accepted token is worth
``p + (1 - p) * m * b / S0`` of them, plus ``(1 - p) * F * b / S0`` for each token by which the
longest remaining output shrinks. At ``b = 1`` both add up to one: a lone request is priced as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dspine import faults

__all__ = ["DrainPricing", "drain_pricing", "shortest_runs"]


@dataclass(frozen=True)
class DrainPricing:
    """How one step's accepted tokens are valued, in target-only tokens of its batch."""

    token_value: float = 1.0  # any accepted token
    # per token by which the batch's longest remaining output shrinks (every one of ``critical``
    # must accept it), at most ``lead`` of them (past that another request is the longest)
    lead_token_value: float = 0.0
    critical: frozenset[str] = frozenset()
    lead: int = 0


FULL = DrainPricing()


def drain_pricing(remaining: Mapping[str, int] | None, drafting_candidates: Sequence[str], refill_share: float,
                  target_line: tuple[float, float] | None) -> DrainPricing:
    """The pricing of a step of the requests in ``remaining`` (request id -> output tokens it may
    still emit; every request of the step) of which ``drafting_candidates`` may draft, when
    ``refill_share`` of freed slots are refilled and a target-only step of ``b`` requests costs
    ``intercept + slope * b`` (``target_line``)."""
    if (remaining is None or target_line is None or refill_share >= 1.0 or len(remaining) < 2
            or faults.active("policy.drain_unpriced")):
        return FULL
    intercept, slope = target_line
    batch = len(remaining)
    step = intercept + slope * batch
    if step <= 0:
        return FULL
    drained = 1.0 - max(0.0, refill_share)
    longest = max(remaining.values())
    critical = frozenset(r for r, n in remaining.items() if n == longest)
    lead_value = drained * intercept * batch / step
    if not critical <= set(drafting_candidates):
        critical, lead_value = frozenset(), 0.0  # a request that cannot draft sets the batch's end
    others = [n for r, n in remaining.items() if r not in critical]
    return DrainPricing(token_value=refill_share + drained * slope * batch / step, lead_token_value=lead_value,
                        critical=critical, lead=longest - max(others, default=0))


def shortest_runs(gains: Sequence[Sequence[float]], rows: int) -> list[float]:
    """Expected accepted tokens of the request that accepts fewest, over its first 1, 2, ..., ``rows``
    rows (a plan reads every row count: one pass over the rows).

    ``gains[i][t]``: request i's P(rows 1..t+1 accepted) (a request verifies no row past its own
    list). Requests accept independently, so P(every one accepts row t) is the product."""
    runs: list[float] = []
    total = 0.0
    for t in range(rows):
        product = 1.0
        for request_gains in gains:
            product *= min(1.0, request_gains[t]) if t < len(request_gains) else 0.0
        total += product
        runs.append(total)
    return runs
