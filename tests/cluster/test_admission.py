"""Ingress admission: live slots run, the queue waits in FIFO order, the next is refused at once."""

from __future__ import annotations

import asyncio

import pytest

from dspine.cluster.admission import Admission
from dspine.cluster.errors import ClusterBusyError, status_for


async def _hold(admission: Admission, log: list, name: str, release: asyncio.Event) -> None:
    async with admission.admit():
        log.append(name)
        await release.wait()


def test_slots_run_queue_waits_fifo_and_overflow_is_refused():
    async def run():
        live = [1]
        admission = Admission(slots_per_replica=2, queue_bound=2, live_replicas=lambda: live[0])
        started: list[str] = []
        releases = {name: asyncio.Event() for name in "abcd"}
        tasks = {name: asyncio.create_task(_hold(admission, started, name, releases[name])) for name in "abcd"}
        await asyncio.sleep(0.01)
        assert started == ["a", "b"] and (admission.running, admission.waiting) == (2, 2)
        with pytest.raises(ClusterBusyError, match="4 requests running or queued, capacity 4") as info:
            async with admission.admit():
                pass
        assert status_for(info.value)[0].name == "RESOURCE_EXHAUSTED"
        releases["b"].set()
        await asyncio.sleep(0.01)
        assert started == ["a", "b", "c"]  # the oldest waiter got b's slot
        live[0] = 2  # a replica came up: its slots go to the waiters
        admission.fill()
        await asyncio.sleep(0.01)
        assert started == ["a", "b", "c", "d"]
        for event in releases.values():
            event.set()
        await asyncio.gather(*tasks.values())
        assert (admission.running, admission.waiting, admission.peak_outstanding) == (0, 0, 4)

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_no_trace():
    # The deadline of a queued request: its place is given up and the next waiter is served.
    async def run():
        admission = Admission(slots_per_replica=1, queue_bound=2, live_replicas=lambda: 1)
        started: list[str] = []
        release = asyncio.Event()
        holder = asyncio.create_task(_hold(admission, started, "holder", release))
        await asyncio.sleep(0)
        expiring = asyncio.create_task(_hold(admission, started, "expiring", asyncio.Event()))
        patient = asyncio.create_task(_hold(admission, started, "patient", asyncio.Event()))
        await asyncio.sleep(0.01)
        expiring.cancel()
        await asyncio.sleep(0.01)
        assert admission.waiting == 1
        release.set()
        await asyncio.sleep(0.01)
        assert started == ["holder", "patient"]
        patient.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        await asyncio.gather(patient, return_exceptions=True)
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(run())


def test_place_is_released_when_the_request_fails():
    async def run():
        admission = Admission(slots_per_replica=1, queue_bound=0, live_replicas=lambda: 1)
        with pytest.raises(ValueError):
            async with admission.admit():
                raise ValueError("boom")
        async with admission.admit():  # would raise ClusterBusyError had the place leaked
            pass

    asyncio.run(run())
