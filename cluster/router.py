"""Load-aware routing: each request goes to the engine replica with the most free capacity.

Serve's default router samples two replicas and compares queue lengths. An
engine replica's capacity is more than its queue: a replica whose draft KV
pool is nearly full, or whose drafter accepts little on its current
traffic, serves a new request worse. The replicas report their load through
``record_routing_stats`` (see :mod:`dspine.cluster.replica_deployment`); this
router ranks every candidate by

1. free request slots: ``max_ongoing_requests`` minus the in-flight count
   this router knows now (Serve's queue-length cache, updated on every send
   and finish), else the replica's last report;
2. free draft KV pool slots (the report);
3. recent mean accepted length (the report): more tokens per step per slot.

and hands Serve one replica per rank, best first. Serve still enforces the
cap: a replica that is full when probed is skipped for the next rank, and
when all are full the request waits in Serve's bounded queue.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def capacity_key(max_ongoing_requests: int, known_in_flight: int | None, stats: dict | None) -> tuple:
    """Sort key of a replica, larger is better: (free slots, free draft slots, recent acceptance)."""
    stats = stats or {}
    in_flight = known_in_flight if known_in_flight is not None else int(stats.get("in_flight", 0))
    return (max_ongoing_requests - in_flight, int(stats.get("free_draft_slots", 0)),
            float(stats.get("recent_accepted_len", 0.0)))


class FreeCapacityRouter(FIFOMixin, RequestRouter):
    """Ranks engine replicas by :func:`capacity_key`, one replica per rank."""

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        cache = self.replica_queue_len_cache

        def key(replica: RunningReplica) -> tuple:
            return capacity_key(replica.max_ongoing_requests, cache.get(replica.replica_id), replica.routing_stats)

        return [[replica] for replica in sorted(candidate_replicas, key=key, reverse=True)]
