"""``dspine bench engine --sweep --through-server``: the sweep through a real standalone server."""

from __future__ import annotations

import statistics

import pytest

from dspine import embedded
from dspine.benchmarks.sweep import format_sweep
from dspine.benchmarks.sweep_server import bench_sweep_server

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
        # every request of both modes streamed its whole output (ignore_eos) in each paired run
        assert row["num_requests"] == group
        assert row["tokens"] == {"target_only": [group * new_tokens] * 2, "speculative": [group * new_tokens] * 2}
        assert len(row["run_speedups"]) == 2 and all(r > 0 for r in row["run_speedups"])
        assert row["speedup"] == pytest.approx(statistics.median(row["run_speedups"]))
    table = format_sweep(rows)
    assert "2 in flight, temperature 0.7" in table and "lowest:" in table
