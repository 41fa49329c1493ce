"""The edge's worker threads: one bounded pool per kind of blocking work, so no kind waits for another.

The event loop must never block, so work that can take a while runs in a
thread. Three kinds, each with its own threads, because sharing one pool made
them wait for each other (issue 20: twelve 1,000,000-character Tokenize calls
held a 2-token Generate for 8 s, and refusals waited for a free thread):

- **tokenize**: Tokenize / Detokenize calls (a long text takes a while to
  encode). ``tokenize_threads`` threads (default: a quarter of the cores, 1
  to 4); at most ``max_waiting`` calls wait
  for one, more are refused with :class:`~dspine.cluster.errors.EdgeBusyError`
  (RESOURCE_EXHAUSTED) instead of queueing without bound.
- **admission**: preparing a generate request (encoding a text prompt,
  rendering chat) and ``engine.add_request``. Its own threads and its own
  bound; a full engine is refused before this (on the loop, lock-free), so
  refusals never wait for these threads either.
- **cancel**: ``engine.cancel`` on a single thread of its own: a cancel
  queues behind nothing but other cancels.

Fault point ``servicer.shared_executor`` puts all three in one pool sized like
the loop's default executor (the old design) to show that the tests catch it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
from typing import Callable, TypeVar

from dspine import faults

from .errors import EdgeBusyError

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["BoundedExecutor", "EdgeExecutors"]


class BoundedExecutor:
    """A thread pool that refuses new work (``EdgeBusyError``) when ``max_waiting`` calls already wait.

    ``pool`` is the underlying ``ThreadPoolExecutor`` (tests occupy its threads through it)."""

    def __init__(self, name: str, threads: int, max_waiting: int):
        self.name = name
        self.threads = threads
        self.max_waiting = max_waiting
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"dspine-{name}")
        self._pending = 0  # submitted and not finished (running + waiting); read and written on the loop

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on this pool's threads; refused at once when the pool's queue is full."""
        if self._pending >= self.threads + self.max_waiting:
            raise EdgeBusyError(f"server busy: {self._pending} {self.name} calls in progress or waiting "
                                f"(limit {self.threads + self.max_waiting}); retry later")
        self._pending += 1
        future = asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))
        future.add_done_callback(self._done)
        return await future

    def _done(self, _future) -> None:
        self._pending -= 1

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class EdgeExecutors:
    """The three pools of one :class:`~dspine.cluster.service.DSpineService` (see the module docstring)."""

    def __init__(self, tokenize_threads: int | None = None, admission_threads: int = 4, max_waiting: int = 64):
        if tokenize_threads is None:  # a quarter of the cores (1 to 4): the engine and the loop need the rest
            tokenize_threads = max(1, min(4, (os.cpu_count() or 1) // 4))
        self.tokenize = BoundedExecutor("tokenize", tokenize_threads, max_waiting)
        self.admission = BoundedExecutor("admission", admission_threads, max_waiting)
        self._cancel = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dspine-cancel")
        self._shared: BoundedExecutor | None = None  # the old design, only under the fault point

    def _shared_pool(self) -> BoundedExecutor:
        if self._shared is None:  # like the loop's default executor: min(32, cpus + 4) threads, no bound
            self._shared = BoundedExecutor("shared", min(32, (os.cpu_count() or 1) + 4), 1 << 30)
        return self._shared

    def tokenize_pool(self) -> BoundedExecutor:
        """The pool Tokenize / Detokenize run in."""
        return self._shared_pool() if faults.active("servicer.shared_executor") else self.tokenize

    def admission_pool(self) -> BoundedExecutor:
        """The pool that encodes and admits generate requests."""
        return self._shared_pool() if faults.active("servicer.shared_executor") else self.admission

    async def run_tokenize(self, fn: Callable[..., T], *args) -> T:
        return await self.tokenize_pool().run(fn, *args)

    async def run_admission(self, fn: Callable[..., T], *args) -> T:
        return await self.admission_pool().run(fn, *args)

    def cancel_soon(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args) -> None:
        """Run ``fn(*args)`` (an engine cancel) on the cancel thread; nobody waits for it."""
        if faults.active("servicer.shared_executor"):
            loop.create_task(self._logged(self._shared_pool().run(fn, *args)))
            return
        try:
            future = self._cancel.submit(fn, *args)
        except RuntimeError:  # shut down: the engine is stopping and cancels everything itself
            return
        future.add_done_callback(_log_failure)

    @staticmethod
    async def _logged(awaitable) -> None:
        with contextlib.suppress(Exception):
            await awaitable

    def shutdown(self) -> None:
        """Stop the threads (waiting work is dropped: the engine's shutdown cancels its requests)."""
        for pool in (self.tokenize, self.admission, self._shared):
            if pool is not None:
                pool.shutdown()
        self._cancel.shutdown(wait=False)


def _log_failure(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("cancelling a request failed", exc_info=future.exception())
