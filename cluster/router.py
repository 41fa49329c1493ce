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

0. whether the request fits the replica's memory: its prompt (token ids, or at most one token per
   byte of text) plus ``max_new_tokens`` against the free tokens of each pool the replica reports
   (``free_target_tokens``, ``free_draft_tokens``: capacity not reserved by its admitted
   requests; see replica/admission.py). A replica where it does not fit would queue it;

and hands Serve one replica per rank, best first. Serve still enforces the
cap: a replica that is full when probed is skipped for the next rank, and
when all are full the request waits in Serve's bounded queue.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def request_tokens(pending_request) -> tuple[int | None, bool]:
    """(positions the request may take, whether it may speculate) from a pending ``GenerateRequest``;
    (None, True) when unknown (not a generate call)."""
    args = getattr(pending_request, "args", None) or ()
    request = args[0] if args else None
    if request is None or not hasattr(request, "WhichOneof"):
        return None, True
    try:
        which = request.WhichOneof("prompt")
    except ValueError:  # not a GenerateRequest
        return None, True
    if which == "token_ids":
        prompt = len(request.token_ids.ids)
    elif which == "text":
        prompt = len(request.text.encode("utf-8"))  # a byte-level BPE token is at least one byte
    elif which == "messages":
        prompt = sum(len(m.content.encode("utf-8")) + len(m.role) + 8 for m in request.messages.messages)
    else:
        return None, True
    max_new = request.sampling.max_new_tokens if request.sampling.HasField("max_new_tokens") else 0
    speculative = request.speculative if request.HasField("speculative") else True
    return prompt + max_new, speculative


def fits_memory(stats: dict, need_tokens: int | None, speculative: bool = True) -> bool:
    """Whether ``need_tokens`` fit every pool the replica reports (an unreported pool is unbounded)."""
    if need_tokens is None:
        return True
    pools = ["free_target_tokens"] + (["free_draft_tokens"] if speculative else [])
    return all(stats.get(p) is None or need_tokens <= int(stats[p]) for p in pools)


def capacity_key(max_ongoing_requests: int, known_in_flight: int | None, stats: dict | None,
                 need_tokens: int | None = None, speculative: bool = True) -> tuple:
    """Sort key of a replica, larger is better: (request fits its memory, free slots, free draft
    slots, recent acceptance)."""
    stats = stats or {}
    in_flight = known_in_flight if known_in_flight is not None else int(stats.get("in_flight", 0))
    return (fits_memory(stats, need_tokens, speculative), max_ongoing_requests - in_flight,
            int(stats.get("free_draft_slots", 0)), float(stats.get("recent_accepted_len", 0.0)))


class FreeCapacityRouter(FIFOMixin, RequestRouter):
    """Ranks engine replicas by :func:`capacity_key`, one replica per rank."""

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        cache = self.replica_queue_len_cache
        need_tokens, speculative = request_tokens(pending_request)

        def key(replica: RunningReplica) -> tuple:
            return capacity_key(replica.max_ongoing_requests, cache.get(replica.replica_id), replica.routing_stats,
                                need_tokens, speculative)

        return [[replica] for replica in sorted(candidate_replicas, key=key, reverse=True)]
