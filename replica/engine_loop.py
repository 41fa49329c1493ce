"""The engine's background loop (``start``/``shutdown``): steps while requests are in flight.

The loop runs on the engine's device thread, so its steps, and the freeing of finished or
cancelled requests' device state, happen where the tensors live. It sleeps on the core's
``_work`` condition and wakes when a request is admitted, cancelled or finished from outside a
step, or when shutdown starts. The :class:`EngineLoop` mixin of ``Engine``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import TimeoutError as FutureTimeoutError

from .types import RequestStatus

logger = logging.getLogger(__name__)


class EngineLoop:
    """``start``, ``shutdown`` and the loop itself over the engine core."""

    def start(self) -> None:
        """Start the background loop (on the device thread) that steps while requests are in flight."""
        with self._lock:
            if self._loop is not None:
                return
            self._stopping = False
            self._loop = self._device_thread.submit(self._run_loop)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; finish (drain) or cancel the in-flight ones; stop the loop."""
        with self._lock:
            self._stopping = True
            if not drain:
                self._deliver(self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_CANCELLED))
            self._work.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        loop = self._loop
        if loop is None:
            while self.has_unfinished() and (deadline is None or time.monotonic() < deadline):
                self.step()
        else:
            with contextlib.suppress(FutureTimeoutError):
                loop.result(timeout)
        with self._lock:
            self._deliver(self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_CANCELLED))
            self._work.notify_all()
        if loop is None or loop.done():
            self.step()  # frees the device state of everything finished
        with self._lock:
            self._loop = None

    def _has_work(self) -> bool:
        """Requests in flight, or finished ones whose device state is still held (under ``_lock``)."""
        return self.scheduler.num_unfinished > 0 or self.scheduler.has_finished_ids

    def _run_loop(self) -> None:
        while True:
            with self._lock:
                while not self._has_work() and not self._stopping:
                    self._work.wait()
                if self._stopping and not self._has_work():
                    return
            try:
                self.step()  # the public one: a test may wrap it (a gate that holds steps)
            except Exception:  # noqa: BLE001 - a bug in the step itself: fail everything in flight, keep serving
                logger.exception("engine step failed; failing in-flight requests")
                with self._lock:
                    ids = list(self.scheduler.requests)
                    self._deliver(self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR, "engine step failed"))
                try:  # here, not in another step: a step that keeps failing must not spin the loop
                    self._free_finished_state()
                except Exception:  # noqa: BLE001
                    logger.exception("freeing the failed requests' device state failed")
