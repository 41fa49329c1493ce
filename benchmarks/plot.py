"""``dspine bench engine --plot FILE.png``: the bench's acceptance and cost as one picture.

Left: how many draft tokens each cycle accepted (0..block-1), the histogram the
speedup rests on. Right: milliseconds per generated token, target-only beside
speculative, the speculative bar split into its stages (per cycle, divided by
the tokens a cycle commits). matplotlib is an optional extra
(``pip install 'dspine-serve[plot]'``); it draws off-screen (Agg), so a headless
machine can write the file.
"""

from __future__ import annotations

from pathlib import Path

STAGE_COLOURS = {"draft": "#4c72b0", "tail": "#55a868", "verify": "#c44e52", "commit": "#8172b2"}


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def require_pyplot():
    """matplotlib's pyplot on the off-screen backend; :class:`PlotUnavailableError` without it."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailableError("--plot needs matplotlib: pip install 'dspine-serve[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_engine_bench(report, path: str | Path) -> Path:
    """Write ``report`` (an :class:`~dspine.benchmarks.engine.EngineBenchReport`) as a PNG; returns the path."""
    plt = require_pyplot()
    path = Path(path)
    figure, (hist_axes, cost_axes) = plt.subplots(1, 2, figsize=(11, 4.2))

    histogram = list(report.accepted_len_histogram)
    hist_axes.bar(range(len(histogram)), histogram, color="#4c72b0")
    hist_axes.set_xlabel("draft tokens accepted in a cycle")
    hist_axes.set_ylabel("cycles")
    hist_axes.set_title(f"accepted length (mean {report.mean_accepted_len:.2f}, "
                        f"verified {report.mean_verified_len:.2f})")
    hist_axes.set_xticks(range(len(histogram)))

    tokens_per_cycle = report.mean_accepted_len + 1.0
    cost_axes.bar([0], [report.target_step_seconds * 1e3], color="#999999", label="target step")
    bottom = 0.0
    for stage, seconds in report.stage_seconds.items():
        height = seconds * 1e3 / tokens_per_cycle
        cost_axes.bar([1], [height], bottom=[bottom], color=STAGE_COLOURS.get(stage, "#dd8452"), label=stage)
        bottom += height
    cost_axes.set_xticks([0, 1], ["target-only step", "speculative cycle / tokens"])
    cost_axes.set_ylabel("ms per generated token")
    cost_axes.set_title(f"speedup {report.speedup:.2f}x (same-run, median of {len(report.run_speedups)} pairs)")
    cost_axes.legend(loc="upper right", fontsize="small")

    figure.suptitle(f"dspine bench engine: {report.num_prompts} prompts, concurrency {report.concurrency}, "
                    f"temperature {report.temperature}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
