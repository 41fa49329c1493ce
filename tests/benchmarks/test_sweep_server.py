"""``dspine bench engine --sweep --through-server``: the sweep through a real standalone server."""

from __future__ import annotations

import statistics

import pytest

from dspine import embedded
from dspine.benchmarks.sweep import Regime, format_sweep
from dspine.benchmarks.sweep_server import bench_sweep_server, served_loads

REGIMES = (("greedy, 6 tokens", {}, 6, 1), ("2 in flight, temperature 0.7", {"temperature": 0.7}, 5, 2))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sweep_through_the_server_pairs_both_modes_of_every_regime():
    prompts = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24]]
    rows = bench_sweep_server(prompts, num_prompts=2, repeats=2, regimes=REGIMES, threads=1,
                              target_dir=embedded.TARGET_DIR, draft_dir=embedded.DRAFT_DIR, groups_in_flight=2)
    assert [row["regime"] for row in rows] == [name for name, *_ in REGIMES]
    for row, (_, _, new_tokens, concurrency) in zip(rows, REGIMES):
        group = len(prompts) if concurrency == 1 else 2 * concurrency  # two groups in flight per repeat
        loads = group // concurrency  # a pair per prompt, or per closed group
        assert row["num_requests"] == group
        # every request of both modes streamed its whole output (ignore_eos) in each repeat
        assert row["tokens"] == {"target_only": [group * new_tokens] * 2, "speculative": [group * new_tokens] * 2}
        assert row["num_pairs"] == 2 * loads and len(row["pair_speedups"]) == 2 * loads
        assert len(row["run_speedups"]) == 2 and all(r > 0 for r in row["run_speedups"])
        assert row["speedup"] == pytest.approx(statistics.median(row["run_speedups"]))
        # a repeat pools its pairs, and any pooled ratio of pairs lies between their lowest and highest
        low, high = row["interval"]
        lowest, highest = min(row["pair_speedups"]) - 1e-9, max(row["pair_speedups"]) + 1e-9
        assert lowest <= low <= high <= highest
        assert all(lowest <= r <= highest for r in row["run_speedups"])
        assert len(row["request_run_speedups"]) == 2 and all(r > 0 for r in row["request_run_speedups"])
        assert row["request_speedup"] == pytest.approx(statistics.median(row["request_run_speedups"]))
    table = format_sweep(rows)
    assert "2 in flight, temperature 0.7" in table and "lowest:" in table


def test_a_served_repeat_pairs_each_prompt_or_closed_group_and_a_refilled_regime_as_one_load():
    group = [[1], [2], [3], [4], [5], [6]]
    lengths = [10, 11, 12, 13, 14, 15]
    assert served_loads(group[:3], lengths[:3], 1, refilled=False) == [([[1]], [10]), ([[2]], [11]), ([[3]], [12])]
    assert served_loads(group, lengths, 2, refilled=False) == [
        ([[1], [2]], [10, 11]), ([[3], [4]], [12, 13]), ([[5], [6]], [14, 15])]
    assert served_loads(group, lengths, 2, refilled=True) == [(group, lengths)]
    # each load keeps its own prompts' lengths: a slice that drifted by one would pair them wrongly
    for load, load_lengths in served_loads(group, lengths, 4, refilled=False):
        assert load_lengths == [10 + prompt[0] - 1 for prompt in load]
    with pytest.raises(ValueError, match="lengths"):
        served_loads(group, lengths[:5], 2, refilled=False)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_served_control_row_streams_both_sides_target_only(monkeypatch):
    """The control row's pairs ask the server for target-only on both sides; a regime's pairs ask
    for one of each, both sides of a load one after the other; a refilled regime streams its
    prompts as one load. (The control regime is shrunk here to keep the test short.)"""
    from dspine.benchmarks import sweep, sweep_server

    control = ("control: target-only vs itself", {}, 4, 2)
    monkeypatch.setattr(sweep, "CONTROL_REGIME", control)
    asked: list[tuple[str, bool, tuple]] = []
    run_load = sweep_server.run_load

    async def recorded(address, name, prompts, concurrency, sampling, **kwargs):
        asked.append((name, sampling["speculative"], tuple(map(tuple, prompts))))
        return await run_load(address, name, prompts, concurrency, sampling, **kwargs)

    monkeypatch.setattr(sweep_server, "run_load", recorded)
    prompts = [[11, 12, 13, 14], [21, 22, 23, 24]]
    refilled = Regime("2 in flight, refilled", {}, 4, 2, refilled=True)
    rows = bench_sweep_server(prompts, num_prompts=2, repeats=2, regimes=REGIMES[:1] + (refilled,), threads=1,
                              target_dir=embedded.TARGET_DIR, draft_dir=embedded.DRAFT_DIR, groups_in_flight=1,
                              control=True)
    assert [row["regime"] for row in rows] == [REGIMES[0][0], refilled.name, control[0]]
    assert [row["control"] for row in rows] == [False, False, True]
    asked = asked[1:]  # the server's warm-up request
    # both modes of each load back to back, alternating which goes first
    pairs = [asked[i:i + 2] for i in range(0, len(asked), 2)]
    assert all(a[0] == b[0] and a[2] == b[2] for a, b in pairs)
    regime_pairs = [(a[1], b[1]) for a, b in pairs if a[0] == REGIMES[0][0]]
    assert regime_pairs == [(False, True), (True, False), (True, False), (False, True)]  # 2 prompts x 2 repeats
    assert [len(a[2]) for a, _ in pairs if a[0] == refilled.name] == [2, 2]  # one load of both prompts a repeat
    assert [s for n, s, _ in asked if n == control[0]] == [False] * 4
    assert "control: both sides" in format_sweep(rows)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_served_regime_with_a_length_spread_streams_each_request_its_own_length():
    """A refilled regime with a length spread asks the server each prompt's own ``max_new_tokens``
    on both sides, and every request streams exactly that many tokens (ignore_eos); the fault that
    drops the spread streams the regime's one length for each and the token count differs."""
    from dspine import faults
    from dspine.benchmarks.sweep import request_lengths

    prompts = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]]
    spread = Regime("3 in flight, refilled, 3-7 tokens", {}, 5, 3, refilled=True, length_spread=4)
    lengths = request_lengths(spread, 4)
    assert sum(lengths) != 4 * 5  # (else the fault's fixed lengths would stream as many tokens)

    def tokens() -> dict:
        rows = bench_sweep_server(prompts, num_prompts=4, repeats=1, regimes=(spread,), threads=1,
                                  target_dir=embedded.TARGET_DIR, draft_dir=embedded.DRAFT_DIR, groups_in_flight=1)
        return rows[0]["tokens"]

    assert tokens() == {"target_only": [sum(lengths)], "speculative": [sum(lengths)]}
    with faults.inject("bench.request_lengths_fixed"):
        assert tokens() == {"target_only": [20], "speculative": [20]}
