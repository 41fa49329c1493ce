"""What the engine reports about itself: counters, the load snapshot, health and the leak check.

Plain data (:class:`EngineStats`, :class:`EngineLoad`) and the :class:`EngineMonitoring` mixin of
:class:`~dspine.replica.engine.Engine` that reads them. Exporters (Prometheus, tracing) live in
cluster/ and read these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .step_stats import StepRecord
from .types import SpecDecodingStats, StageTimes


@dataclass
class EngineStats:
    """Engine-wide counters since start (plain data; exporters live in cluster/)."""

    num_steps: int = 0
    num_finished: int = 0
    num_failed: int = 0
    num_cancelled: int = 0
    stage_times: StageTimes = field(default_factory=StageTimes)
    spec: SpecDecodingStats | None = None
    peak_draft_pool_used: int = 0
    peak_in_flight: int = 0  # high-water mark of admitted, unfinished requests
    num_draft_demoted: int = 0  # speculative requests the draft pool could not extend (went target-only)
    recent_accepted_len: float = 0.0  # accepted draft tokens per cycle, exponentially decayed
    # time.monotonic() at the end of the latest step, or at the admission that ended an idle
    # spell: a health check measures a stall from here.
    last_progress: float = 0.0


# Weight of the newest cycle in ``EngineStats.recent_accepted_len``.
ACCEPTANCE_DECAY = 0.05
# The longest ``num_live_states`` waits for the background loop to free cancelled requests'
# device state (it does so within one step).
FREE_WAIT_S = 5.0


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of how busy the engine is: what a router and a health check read."""

    in_flight: int
    max_concurrency: int
    peak_in_flight: int
    free_draft_slots: int  # 0 without a drafter
    draft_slots: int  # capacity of the draft KV pool (0 without a drafter)
    live_target_states: int
    recent_accepted_len: float
    num_steps: int
    num_finished: int
    seconds_since_progress: float | None  # since the last step or idle-ending admission; None before any
    # Memory admission (replica/admission.py): tokens not reserved by admitted requests, per pool
    # (None: unbounded / no such pool), and requests admitted that wait for memory.
    free_target_tokens: int | None = None
    free_draft_tokens: int | None = None
    waiting_for_memory: int = 0

    @property
    def free_slots(self) -> int:
        return self.max_concurrency - self.in_flight


class EngineMonitoring:
    """The engine's read side: ``load``, ``check_health``, ``num_live_states`` and step observers.

    A mixin of ``Engine``: it reads the attributes the engine core sets (``runner``, ``scheduler``,
    ``admission``, ``stats``, the two locks, the device thread and the loop)."""

    def load(self) -> EngineLoad:
        """How busy the engine is now. Lock-free (plain reads of counters), so a router or health
        probe never waits for a step to end; the fields may be one step apart."""
        pool = self.runner.draft_pool
        stats = self.stats
        free = self.admission.free_tokens()
        return EngineLoad(
            in_flight=self.scheduler.num_unfinished,
            max_concurrency=self.config.max_concurrency,
            peak_in_flight=stats.peak_in_flight,
            free_draft_slots=pool.num_free if pool is not None else 0,
            draft_slots=pool.capacity if pool is not None else 0,
            live_target_states=self.runner.num_live_states,
            recent_accepted_len=stats.recent_accepted_len,
            num_steps=stats.num_steps,
            num_finished=stats.num_finished,
            seconds_since_progress=time.monotonic() - stats.last_progress if stats.last_progress else None,
            free_target_tokens=free.get("target K/V"),
            free_draft_tokens=free.get("draft KV pool"),
            waiting_for_memory=self.scheduler.num_waiting_for_memory(),
        )

    def check_health(self, stall_s: float = 60.0) -> None:
        """Raise ``RuntimeError`` when the engine cannot serve: its device thread or loop died,
        or requests are in flight and no step has finished for ``stall_s`` seconds."""
        if not self._device_thread.is_alive:
            raise RuntimeError("engine device thread is not running")
        loop = self._loop
        if loop is not None and loop.done():
            raise RuntimeError(f"engine loop exited: {loop.exception() or 'returned'}")
        load = self.load()
        stalled_s = load.seconds_since_progress
        if load.in_flight and stalled_s is not None and stalled_s > stall_s:
            raise RuntimeError(f"engine stalled: {load.in_flight} requests in flight, "
                               f"no step finished for {stalled_s:.0f}s")

    def num_live_states(self) -> dict[str, int]:
        """Live target states and draft slots (zero when idle: the leak check).

        Counted once the device state of finished or cancelled requests has been freed (a cancel
        frees it at the next step boundary, on the device thread): this waits for the step in
        progress, unlike ``load()``, and with the background loop for the boundary after it (at
        most ``FREE_WAIT_S``: a loop held outside a step, by a test's gate, is not waited for)."""
        loop = self._loop
        if loop is not None and not loop.done():
            deadline = time.monotonic() + FREE_WAIT_S
            with self._lock:  # the loop frees finished requests' state when it wakes (engine_loop)
                self._work.notify_all()
                while self.scheduler.has_finished_ids and not loop.done() and time.monotonic() < deadline:
                    self._state_freed.wait(timeout=0.05)
            if not loop.done():
                with self._step_lock:
                    return self._live_state_counts()
        return self._device_thread.call(self._free_state_and_count)

    def _free_state_and_count(self) -> dict[str, int]:
        self._free_finished_state()
        return self._live_state_counts()

    def _live_state_counts(self) -> dict[str, int]:
        pool = self.runner.draft_pool
        return {
            "requests": self.scheduler.num_unfinished,
            "target_states": self.runner.num_live_states,
            # draft positions held: in the pool, or kept for it until the request drafts
            "draft_slots": (pool.used if pool is not None else 0) + self.runner.num_deferred_positions(),
            "target_kv_blocks": self.runner.target_kv_used_blocks(),
        }

    def add_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        """Call ``observer(record)`` after every step (on the device thread: keep it cheap)."""
        with self._lock:
            self._step_observers.append(observer)

    def remove_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        with self._lock:
            self._step_observers.remove(observer)

    def set_precise_timing(self, enabled: bool) -> None:
        """Synchronise the device around each stage so stage intervals are device time (CUDA)."""
        self.runner.precise_timing = enabled
