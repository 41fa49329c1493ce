"""FreeCapacityRouter ranks replicas by free slots, then free draft KV slots, then recent acceptance."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dspine.cluster.router import FreeCapacityRouter, capacity_key


@dataclass
class FakeReplica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 8


class FakeCache(dict):
    pass


def _rank(replicas, cache):
    router = FreeCapacityRouter.__new__(FreeCapacityRouter)  # choose_replicas reads only the cache
    router._replica_queue_len_cache = cache
    ranks = asyncio.run(router.choose_replicas(replicas))
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id for rank in ranks]


def test_most_free_slots_first_with_live_counts_over_stale_reports():
    a = FakeReplica("a", {"in_flight": 1, "free_draft_slots": 100})
    b = FakeReplica("b", {"in_flight": 6, "free_draft_slots": 100})
    c = FakeReplica("c", {"in_flight": 0, "free_draft_slots": 100})
    # c's report says idle, but this router has just sent it 7 requests.
    assert _rank([a, b, c], FakeCache(c=7)) == ["a", "b", "c"]
    assert _rank([a, b, c], FakeCache()) == ["c", "a", "b"]


def test_ties_break_on_draft_pool_then_acceptance():
    a = FakeReplica("a", {"in_flight": 2, "free_draft_slots": 10, "recent_accepted_len": 4.0})
    b = FakeReplica("b", {"in_flight": 2, "free_draft_slots": 500, "recent_accepted_len": 1.0})
    c = FakeReplica("c", {"in_flight": 2, "free_draft_slots": 500, "recent_accepted_len": 3.0})
    assert _rank([a, b, c], FakeCache()) == ["c", "b", "a"]


def test_capacity_key_without_a_report():
    assert capacity_key(8, None, None) == (8, 0, 0.0)
    assert capacity_key(8, 3, {"in_flight": 0}) == (5, 0, 0.0)
