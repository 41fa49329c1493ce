"""The one thread that runs an engine's parallel torch work.

Why a thread of its own: with OpenMP builds of torch (the CPU wheels), every
thread that runs a parallel op gets its own OpenMP team. Once one thread has
a team, parallel ops on a *second* thread ran about twice as slow on a 2-core
machine (an fp32 16x256 @ 256x1024 matmul: ~100 us on the thread that loaded
the model, ~200 us on another; the embedded pair's 96-token request 0.34 s
against 0.67 s). Servers drive the engine from a loop thread, so loading on
one thread and stepping on another halved the serving path's speed. The
engine therefore builds its tensors and steps on this thread only.

The rule is process-wide: once any two threads have run parallel torch ops,
*both* stay slow (a probe here: 105 us alone, ~185 us on either thread after
the other one ran one: libgomp then manages more threads than there are
cores and its workers sleep instead of spinning between parallel regions).
So other torch work of the process that runs next to an engine (a
benchmark's probe, say) goes through ``Engine.call_on_device_thread``.

``call(fn)`` runs ``fn`` here and returns its result (directly when already
on this thread); ``submit(fn)`` returns a Future, for long-running work such
as the engine loop.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

_STOP = object()


class DeviceThread:
    """A daemon thread that executes submitted callables one at a time, in order."""

    def __init__(self, name: str = "dspine-device", num_threads: int | None = None):
        # The intra-op thread count is a per-thread OpenMP setting: adopt the creator's
        # (or the one asked for), not the library default of one per core.
        self.num_threads = num_threads or torch.get_num_threads()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def is_current(self) -> bool:
        """True when called from this device thread."""
        return threading.current_thread() is self._thread

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> "Future[T]":
        """Queue ``fn(*args, **kwargs)``; its Future carries the result or the exception."""
        future: Future = Future()
        self._tasks.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run ``fn`` on the device thread and wait for it (inline when already there)."""
        if self.is_current:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Stop after the tasks already queued."""
        self._tasks.put(_STOP)

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        while True:
            task = self._tasks.get()
            if task is _STOP:
                return
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the Future
                future.set_exception(e)
