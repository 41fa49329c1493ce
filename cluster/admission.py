"""Admission at the ingress: the cluster takes what its slots and its queue bound hold, no more.

Serve's ``max_queued_requests`` counts every request its router has not yet
assigned, including a burst that free slots will take a few milliseconds
later: 24 concurrent requests against 2 replicas x 8 slots and a queue of 16
were refused with "num_queued_requests=16" while slots were free. So the
ingress counts for itself: a request is admitted while the requests it has
forwarded and not yet finished are fewer than ``live replicas x
max_concurrency + max_queued_requests``; otherwise it is refused at once
(RESOURCE_EXHAUSTED). Serve's own bound stays as a backstop, set above this
one (see ``ClusterConfig.engine_deployment_options``).

With several ingress replicas each admits its share (the bound is per
ingress, as Serve's is per caller); one ingress replica makes it exact.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from .errors import ClusterBusyError


class Admission:
    """Counts requests in the cluster (running or queued) against the bound; not thread-safe
    (the ingress admits on its event loop)."""

    def __init__(self, slots_per_replica: int, queue_bound: int, live_replicas: Callable[[], int]):
        self.slots_per_replica = slots_per_replica
        self.queue_bound = queue_bound
        self.live_replicas = live_replicas
        self.outstanding = 0
        self.peak_outstanding = 0

    @property
    def capacity(self) -> int:
        """Requests the cluster holds at once: every live slot plus the queue."""
        return self.live_replicas() * self.slots_per_replica + self.queue_bound

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Hold one place for the request inside the block, or raise :class:`ClusterBusyError`."""
        capacity = self.capacity
        if self.outstanding >= capacity:
            raise ClusterBusyError(
                f"cluster is full: {self.outstanding} requests running or queued, capacity {capacity} "
                f"({self.live_replicas()} replicas x {self.slots_per_replica} slots + a queue of "
                f"{self.queue_bound}); retry later")
        self.outstanding += 1
        self.peak_outstanding = max(self.peak_outstanding, self.outstanding)
        try:
            yield
        finally:
            self.outstanding -= 1
