"""``bench engine --sweep``: every regime runs both modes on one engine and lands in one table."""

from __future__ import annotations

import dataclasses

import pytest
from dspine_testing.engines import make_engine

from dspine import faults
from dspine.benchmarks.engine import EngineBenchReport, bench_engine
from dspine.benchmarks.paired import Pair
from dspine.benchmarks.sweep import SWEEP_REGIMES, Regime, bench_sweep, format_sweep, regime_prompts, request_lengths
from dspine.replica.sampling import SamplingParams

REGIMES = (
    ("greedy", {}, 12, 1),
    ("sampled", {"temperature": 0.7, "top_p": 0.9}, 12, 1),
    ("batched", {}, 12, 4),
)


def test_sweep_reports_every_regime_with_same_run_ratios(hybrid_target):
    engine = make_engine(hybrid_target, adaptive_speculation=True, max_concurrency=8)
    rows = bench_sweep(engine, num_prompts=2, prompt_len=6, repeats=1, regimes=REGIMES, groups_in_flight=2)
    assert [row["regime"] for row in rows] == ["greedy", "sampled", "batched"]
    # one request at a time: the prompts themselves; 4 in flight: two groups of 4 per repeat
    assert [row["num_requests"] for row in rows] == [2, 2, 8]
    for row in rows:
        ratio = row["speculative_tokens_per_s"] / row["target_only_tokens_per_s"]
        assert abs(row["speedup"] - ratio) < 1e-9 * ratio  # one paired repeat: the ratio itself
        assert 0.0 <= row["drafting_share"] <= 1.0
        assert len(row["request_run_speedups"]) == 1 and row["request_speedup"] > 0
        # a pair per group: 2 prompts one at a time, 2 groups of 4 in flight
        assert row["num_pairs"] == 2 and row["interval"][0] <= row["interval"][1]
    assert rows[0]["identical_greedy_output"] is True and rows[2]["identical_greedy_output"] is True
    assert rows[1]["identical_greedy_output"] is None  # sampled: no token-for-token claim
    table = format_sweep(rows)
    assert table.count("\n") == len(rows) + 3 and "lowest:" in table and "floor 0.97x by the 95% intervals" in table
    for row in rows:
        assert row["regime"] in table and f"{row['speedup']:.2f}x" in table
        assert f"{row['request_speedup']:.2f}x" in table
        assert f"{row['interval'][0]:.2f}-{row['interval'][1]:.2f}" in table


def test_sweep_without_the_policy_reports_no_drafting_share(hybrid_target):
    engine = make_engine(hybrid_target, adaptive_speculation=False)
    rows = bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=1, regimes=REGIMES[:1])
    assert rows[0]["drafting_share"] is None
    assert "  -  " in format_sweep(rows) or " - " in format_sweep(rows)


def test_regimes_in_flight_decode_several_groups_of_distinct_prompts():
    pool = [[i, i + 1] for i in range(40)]
    assert regime_prompts(pool, 8, 1) == pool[:8]
    in_flight = regime_prompts(pool, 8, 8, groups_in_flight=4)
    # four groups of eight, no prompt twice: a repeat of the 8-in-flight regimes is four paired
    # runs, not one pair of the same 8 prompts whose run-to-run scatter hides a 3% loss
    assert len(in_flight) == 32 and len({tuple(p) for p in in_flight}) == 32
    # a pool too small for that is repeated rather than shrinking the groups
    small = regime_prompts(pool[:3], 2, 4, groups_in_flight=2)
    assert len(small) == 8 and small[:3] == pool[:3] and small[3:6] == pool[:3]


def test_the_table_shows_each_regimes_spread_over_its_repeats(hybrid_target):
    engine = make_engine(hybrid_target, adaptive_speculation=True, max_concurrency=8)
    rows = bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=2, regimes=REGIMES[:1])
    low, high = min(rows[0]["run_speedups"]), max(rows[0]["run_speedups"])
    assert len(rows[0]["run_speedups"]) == 2
    assert f"{low:.2f}-{high:.2f}" in format_sweep(rows)


def recorded_loads(engine, monkeypatch) -> list[tuple[int, int | None]]:
    """(prompts, max_in_flight) of each ``engine.generate_many`` call from now on."""
    loads: list[tuple[int, int | None]] = []
    generate_many = engine.generate_many

    def recorded(prompts, params, speculative=None, request_ids=None, max_in_flight=None):
        loads.append((len(prompts), max_in_flight))
        return generate_many(prompts, params, speculative, request_ids, max_in_flight)

    monkeypatch.setattr(engine, "generate_many", recorded)
    return loads


def test_a_regime_in_flight_decodes_group_by_group_or_as_one_load_that_keeps_its_slots_full(hybrid_target, monkeypatch):
    """By default each group of 4 of the 4-in-flight regime is a load of its own; with
    ``keep_in_flight`` the two groups' prompts go to the engine as one load with 4 in flight (a
    finished request's slot goes to the next prompt)."""
    engine = make_engine(hybrid_target, adaptive_speculation=True, max_concurrency=8)
    loads = recorded_loads(engine, monkeypatch)
    bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=1, regimes=REGIMES[2:], groups_in_flight=2)
    assert [load for load in loads if load[0] > 1] == [(4, 4)] * 4  # two groups, both modes
    loads.clear()
    bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=1, regimes=REGIMES[2:], groups_in_flight=2,
                keep_in_flight=True)
    assert [load for load in loads if load[0] > 1] == [(8, 4), (8, 4)]  # target-only, speculative


def test_a_refilled_regime_is_one_load_beside_its_closed_twin(hybrid_target, monkeypatch):
    """The sweep's refilled row decodes its groups' prompts as one load with its slots refilled,
    whatever ``keep_in_flight`` says, next to the closed groups of its twin; one pair per repeat
    (a whole load), against one per group for the twin. With ``keep_in_flight`` it is left out."""
    engine = make_engine(hybrid_target, adaptive_speculation=True, max_concurrency=8)
    loads = recorded_loads(engine, monkeypatch)
    regimes = (Regime("closed", {}, 8, 4), Regime("refilled", {}, 8, 4, refilled=True))
    rows = bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=2, regimes=regimes, groups_in_flight=2)
    assert [row["regime"] for row in rows] == ["closed", "refilled"]
    assert [row["num_pairs"] for row in rows] == [4, 2]
    assert [load for load in loads if load[0] > 1] == [(4, 4)] * 8 + [(8, 4)] * 4
    assert [row["regime"] for row in bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=1, regimes=regimes,
                                                 groups_in_flight=2, keep_in_flight=True)] == ["closed"]
    assert any(regime.refilled and regime.concurrency == 8 and not regime.overrides for regime in SWEEP_REGIMES)


def test_the_control_row_decodes_both_sides_target_only(hybrid_target):
    """The control row's "speculative" side never drafts (the policy plans no step for it), its greedy
    outputs match, and the table's lowest line leaves it out."""
    engine = make_engine(hybrid_target, adaptive_speculation=True, max_concurrency=8)
    rows = bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=1, regimes=REGIMES[:1], control=True)
    policy = engine.scheduler.policy
    planned_before = policy.num_decode_steps
    control = bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=1, regimes=(), control=True,
                          groups_in_flight=1)
    assert policy.num_decode_steps == planned_before  # no speculative request decoded
    assert [row["regime"] for row in rows] == ["greedy", "control: target-only vs itself"]
    assert control[0]["control"] and control[0]["identical_greedy_output"] is True
    assert control[0]["drafting_share"] is None and control[0]["mean_accepted_len"] is None
    rows[1]["speedup"] = 0.5  # even a control far below every regime is not the sweep's lowest
    table = format_sweep(rows)
    assert "lowest: " + f"{rows[0]['speedup']:.2f}x (greedy)" in table and "control: both sides" in table


def test_a_request_latency_runs_from_its_own_admission(hybrid_target):
    """One load of 3 prompts decoded one at a time: each request's latency runs from its own admission,
    so the three add up to at most the load's run time. Counted from the load's start (the fault
    ``bench.latency_from_load_start``), the second and third would also count the wait for their slot."""
    engine = make_engine(hybrid_target, adaptive_speculation=True, max_concurrency=8)
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]
    params = SamplingParams(max_new_tokens=12)

    def latency_share(report) -> list[float]:
        runs = report.target_only_run_seconds + report.speculative_run_seconds
        means = report.target_only_request_seconds + report.speculative_request_seconds
        return [len(prompts) * mean / run for mean, run in zip(means, runs)]

    report = bench_engine(None, None, params, concurrency=1, engine=engine, prompts=prompts, repeats=2, load_size=3)
    assert len(report.request_speedups) == 2
    assert all(0.5 < share <= 1.0 for share in latency_share(report)), latency_share(report)
    with faults.inject("bench.latency_from_load_start"):
        report = bench_engine(None, None, params, concurrency=1, engine=engine, prompts=prompts, repeats=2,
                              load_size=3)
    assert all(share > 1.5 for share in latency_share(report)), latency_share(report)


def test_the_per_request_ratio_compares_mean_latencies_not_the_loads_tokens_per_second():
    """Three repeats whose loads took as long in both modes (ratio 1) while the speculative requests
    finished sooner on average in one, as soon in one and later in one: the per-request ratio is
    read from the mean latencies alone."""
    report = EngineBenchReport(
        num_prompts=8, concurrency=8, temperature=0.0, target_only_tokens=1024, speculative_tokens=1024,
        repeat_pairs=[[Pair(2.0, 2.0, 1024, 1024)] for _ in range(3)],
        mean_accepted_len=1.0, mean_verified_len=2.0, accepted_len_histogram=[], stage_seconds={},
        target_step_seconds=0.01, cycle_seconds=0.02, identical_greedy_output=True,
        target_only_request_seconds=[2.0, 1.8, 2.0], speculative_request_seconds=[1.6, 1.8, 2.5])
    assert report.run_speedups == [1.0, 1.0, 1.0]
    assert report.request_speedups == pytest.approx([1.25, 1.0, 0.8])
    assert report.request_speedup == pytest.approx(1.0)
    assert "per request        1.00x" in report.format()
    single = dataclasses.replace(report, concurrency=1)
    assert "per request" not in single.format()  # one at a time: the same figure as the speedup


def test_the_interval_is_over_every_paired_group_and_the_floor_line_reads_it(hybrid_target):
    """Two repeats of two groups of 4 in flight: four pairs, each a group's two modes, whose pooled ratio
    lies in the interval; the floor line puts each regime by its interval (below, undecided, above)."""
    from dspine.benchmarks.paired import pooled_ratio

    engine = make_engine(hybrid_target, adaptive_speculation=True, max_concurrency=8)
    report = bench_engine(None, None, SamplingParams(max_new_tokens=8), concurrency=4, engine=engine,
                          prompts=[[3 + i, 4, 5, 6] for i in range(8)], repeats=2)
    assert len(report.pairs) == 4 and all(p.target_only_tokens == p.speculative_tokens == 32 for p in report.pairs)
    # each repeat holds its own two groups, whose seconds add up to its run on each side
    assert [len(pairs) for pairs in report.repeat_pairs] == [2, 2]
    assert all(run > max(p.speculative_seconds for p in pairs)
               for run, pairs in zip(report.speculative_run_seconds, report.repeat_pairs))
    low, high = report.interval
    assert low <= pooled_ratio(report.pairs) <= high
    assert f"95% interval  {low:.2f}-{high:.2f}" in report.format()
    row = {"regime": "r", "target_only_tokens_per_s": 1.0, "speculative_tokens_per_s": 1.0, "speedup": 1.0,
           "run_speedups": [1.0, 1.0], "request_speedup": 1.0, "mean_accepted_len": 1.0, "mean_verified_len": 1.0,
           "drafting_share": 0.5, "identical_greedy_output": None, "num_pairs": 8}
    rows = [{**row, "regime": "slow", "interval": (0.90, 0.95)}, {**row, "regime": "close", "interval": (0.95, 1.0)},
            {**row, "regime": "fast", "interval": (1.2, 1.4)}, {**row, "regime": "one pair", "interval": (0.5, 0.5),
                                                                 "num_pairs": 1}]
    floor_line = format_sweep(rows).splitlines()[-1]
    assert floor_line == ("floor 0.97x by the 95% intervals: below it: slow; cannot be told from it: close; "
                          "at or above it: fast")


def test_a_regime_with_a_length_spread_gives_each_request_its_own_length(hybrid_target):
    """Each request of a regime with a length spread asks its own ``max_new_tokens`` on both sides
    (neighbours far apart, every length within the spread); the fault that drops the spread gives
    every request the regime's one length and the check fails."""
    spread = Regime("refilled, 6-10 tokens", {}, 8, 3, refilled=True, length_spread=4)
    lengths = request_lengths(spread, 6)  # 2 groups of 3
    assert min(lengths) >= 6 and max(lengths) <= 10 and len(set(lengths)) == 5
    assert sum(lengths) != 6 * 8  # (else the fault's fixed lengths would emit as many tokens)
    assert all(a != b for a, b in zip(lengths, lengths[1:]))
    assert request_lengths(Regime("fixed", {}, 8, 4), 3) == [8, 8, 8]
    assert any(regime.length_spread for regime in SWEEP_REGIMES)

    engine = make_engine(hybrid_target, adaptive_speculation=True, max_concurrency=8)

    def tokens_of_one_repeat() -> dict:
        row = bench_sweep(engine, num_prompts=1, prompt_len=4, repeats=1, regimes=(spread,), groups_in_flight=2)[0]
        return row["tokens"]

    assert tokens_of_one_repeat() == {"target_only": [sum(lengths)], "speculative": [sum(lengths)]}
    with faults.inject("bench.request_lengths_fixed"):
        assert tokens_of_one_repeat() != {"target_only": [sum(lengths)], "speculative": [sum(lengths)]}


def test_the_table_columns_line_up_past_a_long_regime_name():
    row = {"regime": "8 in flight, greedy, refilled, 96-160 tokens", "target_only_tokens_per_s": 600.0,
           "speculative_tokens_per_s": 700.0, "speedup": 1.17, "run_speedups": [1.1, 1.2], "interval": (1.0, 1.3),
           "num_pairs": 4, "request_speedup": 1.2, "mean_accepted_len": None, "mean_verified_len": None,
           "drafting_share": None, "identical_greedy_output": None}
    lines = format_sweep([row, {**row, "regime": "short"}]).splitlines()
    assert lines[2].index(" t/s") == lines[3].index(" t/s")  # both rows' first figure ends in one column
    assert lines[0].index("target-only") < lines[2].index(" t/s") and len(lines[1]) >= len(lines[2]) - 12
