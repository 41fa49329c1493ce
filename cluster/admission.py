"""Admission and queueing at the ingress: the cluster's bound, its FIFO queue, and no probe storms.

Two measured problems with leaving the queue to Serve's router:

- Serve's ``max_queued_requests`` counts every request its router has not yet
  assigned, including a burst that free slots take a few milliseconds later:
  24 concurrent requests against 2 replicas x 8 slots and a queue of 16 were
  refused ("num_queued_requests=16") while slots were free.
- Requests queued in Serve's router probe the full replicas' queue lengths
  again and again (an actor task each); under load those probes held the GIL
  in the replica process so often that a 1-replica cluster with 16 streams
  in flight ran at half the engine's throughput.

So the ingress keeps the queue itself. A request is admitted while the
requests it holds (running + waiting) are fewer than ``live replicas x
max_concurrency + max_queued_requests``, else refused at once
(RESOURCE_EXHAUSTED). An admitted request is forwarded only when one of the
live slots is free; otherwise it waits here, first come first served, until
a forwarded request ends or its own deadline cancels it. Serve's bound stays
as a backstop above this one (``ClusterConfig.engine_deployment_options``).

With several ingress replicas each admits its share (the bound is per
ingress, as Serve's is per caller); one ingress replica makes it exact.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import AsyncIterator, Callable

from .errors import ClusterBusyError


class Admission:
    """Counts the ingress's requests against the cluster's slots and queue bound.

    Not thread-safe: the ingress admits on its one event loop.
    """

    def __init__(self, slots_per_replica: int, queue_bound: int, live_replicas: Callable[[], int]):
        self.slots_per_replica = slots_per_replica
        self.queue_bound = queue_bound
        self.live_replicas = live_replicas
        self.running = 0  # forwarded to an engine replica and not finished
        self.peak_outstanding = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def slots(self) -> int:
        return self.live_replicas() * self.slots_per_replica

    @property
    def waiting(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.done())

    @property
    def outstanding(self) -> int:
        return self.running + self.waiting

    @property
    def capacity(self) -> int:
        """Requests the cluster holds at once: every live slot plus the queue."""
        return self.slots + self.queue_bound

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold a slot inside the block (waiting for one in FIFO order), or raise
        :class:`ClusterBusyError` at once when the cluster and its queue are full."""
        capacity = self.capacity
        if self.outstanding >= capacity:
            raise ClusterBusyError(
                f"cluster is full: {self.outstanding} requests running or queued, capacity {capacity} "
                f"({self.live_replicas()} replicas x {self.slots_per_replica} slots + a queue of "
                f"{self.queue_bound}); retry later")
        if self.running < self.slots and not self.waiting:
            self.running += 1
        else:
            await self._wait_for_slot()
        self.peak_outstanding = max(self.peak_outstanding, self.outstanding)
        try:
            yield
        finally:
            self.running -= 1
            self.fill()

    async def _wait_for_slot(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.peak_outstanding = max(self.peak_outstanding, self.outstanding)
        try:
            await waiter  # fill() counts us in ``running`` before it wakes us
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted and cancelled in one go: pass it on
                self.running -= 1
                self.fill()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def fill(self) -> None:
        """Hand free slots to the oldest waiters (also called when more replicas come up)."""
        while self._waiters and self.running < self.slots:
            waiter = self._waiters.popleft()
            if waiter.done():  # cancelled while waiting
                continue
            self.running += 1
            waiter.set_result(None)
