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


def _rank(replicas, cache, pending_request=None):
    router = FreeCapacityRouter.__new__(FreeCapacityRouter)  # choose_replicas reads only the cache
    router._replica_queue_len_cache = cache
    ranks = asyncio.run(router.choose_replicas(replicas, pending_request))
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
    assert capacity_key(8, None, None) == (True, 8, 0, 0.0)
    assert capacity_key(8, 3, {"in_flight": 0}) == (True, 5, 0, 0.0)


@dataclass
class FakePending:
    args: list


def test_a_request_goes_where_it_fits_in_memory():
    from dspine.protos.dspine.v1 import dspine_pb2 as pb

    # a has more free request slots, but only b's pools hold 1,000 prompt tokens + 500 new ones
    a = FakeReplica("a", {"in_flight": 0, "free_draft_slots": 900, "free_target_tokens": 4000,
                          "free_draft_tokens": 900})
    b = FakeReplica("b", {"in_flight": 3, "free_draft_slots": 5000, "free_target_tokens": None,
                          "free_draft_tokens": 5000})
    big = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 1000), sampling=pb.SamplingParams(max_new_tokens=500))
    assert _rank([a, b], FakeCache(), FakePending([big])) == ["b", "a"]
    small = pb.GenerateRequest(text="x" * 100, sampling=pb.SamplingParams(max_new_tokens=50))
    assert _rank([a, b], FakeCache(), FakePending([small])) == ["a", "b"]  # fits both: free slots decide
    # target-only: the draft pool does not matter
    target_only = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 1000), speculative=False,
                                     sampling=pb.SamplingParams(max_new_tokens=500))
    assert _rank([a, b], FakeCache(), FakePending([target_only])) == ["a", "b"]
    assert _rank([a, b], FakeCache(), FakePending([pb.TokenizeRequest()])) == ["a", "b"]  # not a generate call


def test_status_shows_free_tokens_per_pool():
    from dspine.cluster.launch import format_status

    report = {"replica": "r1", "pid": 1, "in_flight": 2, "max_concurrency": 8, "peak_in_flight": 3,
              "free_draft_slots": 100, "free_target_tokens": None, "free_draft_tokens": 5000,
              "recent_accepted_len": 2.5, "num_finished": 7, "healthy": True}
    assert "-/5,000" in format_status("dspine", "RUNNING", [report])
