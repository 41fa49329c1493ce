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

import json
from dataclasses import dataclass, field
from pathlib import Path

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


def chrome_trace(records: list[StepRecord]) -> dict:
    """Step records as a Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one lane
    of steps, one of their stages, one per request with the stages it took part in."""
    if not records:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = records[0].start
    lanes: dict[str, int] = {}

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict] = []
    for record in records:
        events.append({"name": f"step {record.index}", "ph": "X", "pid": 1, "tid": 0, "ts": us(record.start),
                       "dur": us(record.end) - us(record.start),
                       "args": {"batch": len(record.request_ids), "accepted_len": record.accepted_len,
                                "verified_rows": record.num_verified}})
        for interval in record.intervals:
            common = {"name": interval.stage, "ph": "X", "pid": 1, "ts": us(interval.start),
                      "dur": us(interval.end) - us(interval.start)}
            events.append({**common, "tid": 1, "args": {"requests": len(interval.request_ids)}})
            for request_id in interval.request_ids:
                lane = lanes.setdefault(request_id, 2 + len(lanes))
                events.append({**common, "tid": lane, "args": {"request_id": request_id}})
    names = {0: "engine steps", 1: "engine stages", **{lane: f"request {rid}" for rid, lane in lanes.items()}}
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
               for tid, name in names.items()]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(records: list[StepRecord], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(records)))
    return path
