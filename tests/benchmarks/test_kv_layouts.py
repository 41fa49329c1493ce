"""``bench engine --kv-layouts``: both layouts, both modes, one table with same-run ratios and K/V traffic."""
from __future__ import annotations

from dspine.benchmarks.kv_layouts import bench_kv_layouts, format_kv_layouts
from dspine.replica.models.dspine_checkpoint import init_random_drafter
from dspine.replica.models.dspine_config import DraftArgs


def test_kv_layouts_bench_reports_both_layouts_with_their_traffic(hybrid_target):
    args = DraftArgs.for_target(hybrid_target.args, window=8, num_retrieve=32)
    drafter = init_random_drafter(hybrid_target, args, seed=0).eval()
    report = bench_kv_layouts(num_requests=3, prompt_len=20, new_tokens=6, repeats=1, dtype="float32",
                              models=(hybrid_target, drafter))
    rows = {row["mode"]: row for row in report["rows"]}
    assert set(rows) == {"target-only", "speculative"}
    for row in rows.values():
        assert row["identical_output"] is True
        (run_ratio,) = row["run_ratios"]  # one repeat: its throughput ratio
        assert abs(run_ratio - row["paged_tokens_per_s"] / row["contiguous_tokens_per_s"]) < 1e-9 * run_ratio
        assert row["paired_steps"] >= 1 and row["ratio"] > 0
        assert row["contiguous_copied_per_step"] > 0 and row["paged_gathered_per_step"] > 0
        assert 0 < row["paged_written_per_step"] < row["contiguous_copied_per_step"]
    # target-only decode: 3 requests x 1 row x the full-attention layers' K and V
    full = len(hybrid_target.args.full_layer_ids)
    assert rows["target-only"]["paged_written_per_step"] == 3 * full * 2 * 2 * 16 * 4
    table = format_kv_layouts(report)
    assert "target-only" in table and "speculative" in table and f"{rows['speculative']['ratio']:.2f}x" in table
