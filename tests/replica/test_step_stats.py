"""Per-request stage times are the request's own measured intervals, never a share of a batched step."""

from __future__ import annotations

import pytest

from dspine.replica import SamplingParams
from dspine.replica.step_stats import STAGES

from .conftest import make_engine


def _run_mixed_batch(engine):
    records = []
    engine.add_step_observer(records.append)
    prompts = [[3, 5, 7, 11] * (1 + i) for i in range(4)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 12, 30, 18)]
    # Mixed: two drafting requests, two target-only ones, of different lengths, in one batch.
    results = []
    ids = []
    sinks = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        request_id = f"r{i}"
        chunks = []
        sinks[request_id] = chunks
        engine.add_request(prompt, p, speculative=i % 2 == 0, request_id=request_id, sink=chunks.append)
        ids.append(request_id)
    while engine.has_unfinished():
        engine.step()
    for request_id in ids:
        results.append(sinks[request_id][-1].stats)
    return records, dict(zip(ids, results))


def test_a_drafting_requests_verify_time_is_the_wall_time_of_its_verify_stages(hybrid_target):
    engine = make_engine(hybrid_target, max_seq_len=128)
    records, stats = _run_mixed_batch(engine)
    assert max(len(r.request_ids) for r in records) == 4  # they really shared steps
    for request_id, s in stats.items():
        for stage in STAGES:
            walls = sum(i.duration for r in records for i in r.intervals
                        if i.stage == stage and request_id in i.request_ids)
            assert getattr(s.stage_times, stage) == pytest.approx(walls, rel=1e-9, abs=1e-12), (request_id, stage)
        assert [r.index for r in s.steps] == [r.index for r in records if request_id in r.request_ids]
    drafting = stats["r0"]
    assert drafting.stage_times.verify > 0 and drafting.stage_times.target_step == 0
    assert stats["r1"].stage_times.verify == 0 and stats["r1"].stage_times.target_step > 0


def test_stage_times_add_up_to_the_requests_wall_time_in_steps(hybrid_target):
    # A 1/B split of each step would give about a quarter of the wall time here.
    engine = make_engine(hybrid_target, max_seq_len=128)
    _, stats = _run_mixed_batch(engine)
    for request_id, s in stats.items():
        t = s.stage_times
        total = t.prefill + t.draft + t.tail + t.verify + t.commit + t.target_step + t.other
        # The wall time of the steps it took part in (not finish - scheduled: the gaps between steps
        # grow with thread wake-up latency on a loaded machine and belong to no stage).
        wall_in_steps = sum(step.duration for step in s.steps)
        assert total == pytest.approx(wall_in_steps, rel=1e-6), (request_id, total, wall_in_steps)
        assert wall_in_steps <= s.finish_time - s.scheduled_time + 1e-9
        assert s.arrival_time <= s.scheduled_time <= s.first_token_time <= s.finish_time
        assert sum(n for _, n in s.token_times) >= s.num_output_tokens


def test_an_observer_that_raises_does_not_break_the_step(hybrid_target):
    engine = make_engine(hybrid_target, max_seq_len=64)
    engine.add_step_observer(lambda record: 1 / 0)
    result = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(result.token_ids) == 5


def test_chrome_trace_has_a_lane_per_request_and_every_stage(hybrid_target):
    from dspine.replica.step_stats import chrome_trace

    engine = make_engine(hybrid_target, max_seq_len=128)
    records, stats = _run_mixed_batch(engine)
    events = chrome_trace(records)["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert lanes == {"engine steps", "engine stages", *(f"request r{i}" for i in range(4))}
    stage_events = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert len(stage_events) == sum(len(r.intervals) for r in records)
    assert {e["name"] for e in stage_events} == {"prefill", "draft", "tail", "verify", "commit", "target_step"}
    # A request's lane holds exactly its own intervals, whose durations sum to its stage times.
    lane_r0 = {e["tid"] for e in events if e["ph"] == "X" and e.get("args", {}).get("request_id") == "r0"}
    assert len(lane_r0) == 1
    verify_us = sum(e["dur"] for e in events if e["tid"] in lane_r0 and e["name"] == "verify")
    assert verify_us == pytest.approx(stats["r0"].stage_times.verify * 1e6, rel=1e-3)
