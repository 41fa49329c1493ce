"""The engine's step records: what ran in each step, when, and for which requests.

This is the one owner of engine timing. The model runner appends a
:class:`StageInterval` for every stage it runs (its wall interval and the
requests that took part); the engine wraps them into a :class:`StepRecord`
per step, charges every request of the step with *its own* intervals
(:meth:`StepRecord.own_times`: a request in a verify of 4 rows is charged
that verify's whole wall time, not a quarter of it; time the step spent on
other requests' stages is its ``other``), and hands the record to observers.
Exporters (tracing, metrics, the Perfetto trace of ``bench engine``) read
these records and never reach into the engine.

Times are ``time.perf_counter()`` seconds. On CUDA a stage's interval is the
host time between launches unless precise timing is switched on
(``Engine.set_precise_timing``), which synchronises the device around each
stage: only tracing and profiling ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import StageTimes

STAGES = ("prefill", "draft", "tail", "verify", "commit", "target_step")


@dataclass(frozen=True)
class StageInterval:
    """One stage run of one step: ``[start, end)`` for ``request_ids``."""

    stage: str  # one of STAGES
    start: float
    end: float
    request_ids: tuple[str, ...]

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class StepRecord:
    """Everything one engine step did (immutable once the step has ended)."""

    index: int
    start: float
    end: float
    intervals: list[StageInterval] = field(default_factory=list)
    num_verified: dict[str, int] = field(default_factory=dict)  # per speculative request: draft rows verified
    accepted_len: dict[str, int] = field(default_factory=dict)  # per speculative request: draft tokens accepted

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def request_ids(self) -> list[str]:
        """Requests that took part in any stage of this step, in first-seen order."""
        seen: dict[str, None] = {}
        for interval in self.intervals:
            for request_id in interval.request_ids:
                seen.setdefault(request_id, None)
        return list(seen)

    def own_times(self, request_id: str) -> StageTimes:
        """The wall time of each stage ``request_id`` took part in; ``other`` = the rest of the step."""
        times = StageTimes()
        own = 0.0
        for interval in self.intervals:
            if request_id in interval.request_ids:
                setattr(times, interval.stage, getattr(times, interval.stage) + interval.duration)
                own += interval.duration
        times.other = max(0.0, self.duration - own)
        return times
