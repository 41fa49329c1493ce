"""``dspine bench engine --plot``: what the picture shows, and a clear error without matplotlib."""

from __future__ import annotations

import sys

import pytest

from dspine.benchmarks.plot import PlotUnavailableError, plot_engine_bench, require_pyplot
from dspine.cluster.cli import main
from dspine.benchmarks.engine import EngineBenchReport
from dspine.benchmarks.paired import Pair


def _report() -> EngineBenchReport:
    return EngineBenchReport(
        num_prompts=2, concurrency=1, temperature=0.0, target_only_tokens=64, speculative_tokens=64,
        repeat_pairs=[[Pair(1.0, 0.5, 64, 64)]], mean_accepted_len=3.0, mean_verified_len=15.0,
        accepted_len_histogram=[4, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6],
        stage_seconds={"draft": 0.004, "tail": 0.002, "verify": 0.008, "commit": 0.002},
        target_step_seconds=0.006, cycle_seconds=0.016, identical_greedy_output=True, config={})


def test_the_plot_draws_the_histogram_and_the_per_token_stages(tmp_path, monkeypatch):
    drawn = {}
    plt = require_pyplot()
    real_subplots = plt.subplots

    def subplots(*args, **kwargs):
        figure, axes = real_subplots(*args, **kwargs)
        drawn["axes"] = axes
        return figure, axes

    monkeypatch.setattr(plt, "subplots", subplots)
    path = plot_engine_bench(_report(), tmp_path / "out.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    hist_axes, cost_axes = drawn["axes"]
    assert [round(p.get_height()) for p in hist_axes.patches] == _report().accepted_len_histogram
    heights = [p.get_height() for p in cost_axes.patches]
    # target-only 6 ms per token; speculative per cycle 16 ms over 4 tokens, stage by stage
    assert heights == pytest.approx([6.0, 1.0, 0.5, 2.0, 0.5])
    assert "speedup 2.00x" in cost_axes.get_title()


def test_without_matplotlib_plot_is_one_clear_error_before_any_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(PlotUnavailableError, match=r"pip install 'dspine-serve\[plot\]'"):
        require_pyplot()
    assert main(["bench", "engine", "--plot", "x.png", "--target", "/nonexistent", "--draft", "/nonexistent"]) == 2
    assert "needs matplotlib" in capsys.readouterr().err
