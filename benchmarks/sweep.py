"""``dspine bench engine --sweep``: every sampling / concurrency regime through ``bench_engine`` on one engine."""

from __future__ import annotations

from typing import NamedTuple

from dspine import faults
from dspine.replica.engine import Engine
from dspine.replica.sampling import SamplingParams

from .engine import bench_engine
from .paired import floor_verdict
from .prompts import heldout_prompts


class Regime(NamedTuple):
    """One row of ``dspine bench engine --sweep``: what its requests ask and how many run at once."""

    name: str
    overrides: dict  # sampling parameters beside max_new_tokens
    max_new_tokens: int
    concurrency: int
    # With several in flight: the groups' prompts as one load whose freed slots go to the next
    # prompt (a replica under load), instead of closed groups that each run to their last request.
    refilled: bool = False
    # Each request's own output length: max_new_tokens -/+ half of this, spread evenly over the
    # prompts (0: every request asks max_new_tokens). With one fixed length and ignore_eos, the
    # target-only side of a refilled load finishes its 8 requests on one step, so their 8
    # replacements arrive together and prefill as one batch (98 ms for 8 prompts of 64 tokens on the
    # 2-core CPU, 22 ms for one), while the speculative side's requests finish steps apart and
    # prefill one by one. A replica's real requests end at their own lengths on both sides.
    length_spread: int = 0


# The regimes of ``dspine bench engine --sweep``. The two 8-in-flight greedy rows read the same
# prompts two ways: closed groups (the speculative side ends each group in a thinner batch, its
# requests finishing at different steps) and one refilled load, where no group has an end.
SWEEP_REGIMES = (
    Regime("greedy, 128 new tokens", {}, 128, 1),
    Regime("greedy, first 48 new tokens", {}, 48, 1),
    Regime("temperature 0.7", {"temperature": 0.7}, 128, 1),
    Regime("temperature 0.7, top-p 0.9", {"temperature": 0.7, "top_p": 0.9}, 128, 1),
    Regime("8 in flight, greedy", {}, 128, 8),
    Regime("8 in flight, greedy, refilled", {}, 128, 8, refilled=True),
    Regime("8 in flight, greedy, refilled, 96-160 tokens", {}, 128, 8, refilled=True, length_spread=64),
    Regime("8 in flight, temperature 0.7", {"temperature": 0.7}, 128, 8),
)


# Groups of distinct prompts per repeat in a regime with several requests in flight. One group of 8
# decodes in about 3.5 s on the 2-core CPU and two such runs differ by up to 10% on their own, so
# a repeat made of a single pair could not tell 0.97x from 1.0x; four pairs per repeat, each pair
# adjacent in time, average most of that out.
GROUPS_IN_FLIGHT = 4


# The sweep's control row: the 8-in-flight greedy regime with both sides of every pair decoding
# target-only. Its ratio should be 1; its spread is what this machine's drift alone does to a
# paired ratio in the same run, the yardstick for a regime a few percent from 1.
CONTROL_REGIME = Regime("control: target-only vs itself", {}, 128, 8)


# The ratio below which speculation is held to cost a regime throughput: the adaptive policy's floor.
# The table says which regimes' intervals lie wholly under it, wholly over it, or straddle it.
SPEED_FLOOR = 0.97


def regime_prompts(prompts: list[list[int]], num_prompts: int, concurrency: int,
                   groups_in_flight: int = GROUPS_IN_FLIGHT) -> list[list[int]]:
    """The prompts of one regime: the first ``num_prompts`` one at a time; with ``concurrency`` in
    flight, ``groups_in_flight`` groups of ``concurrency`` distinct prompts (repeated only where
    ``prompts`` holds fewer)."""
    if concurrency == 1:
        return prompts[:num_prompts]
    wanted = max(num_prompts, concurrency * groups_in_flight)
    return (prompts * (wanted // len(prompts) + 1))[:wanted]


def request_lengths(regime: Regime, num_requests: int) -> list[int]:
    """Each request's ``max_new_tokens`` in a regime of ``num_requests``: ``regime.max_new_tokens``
    for all, or with a :attr:`Regime.length_spread` a deterministic spread over
    ``max_new_tokens -/+ spread / 2`` (a stride coprime to the spread's width, so neighbouring
    prompts, which run together, ask lengths far apart)."""
    if faults.active("bench.request_lengths_fixed") or regime.length_spread <= 0:
        return [regime.max_new_tokens] * num_requests
    width = regime.length_spread + 1
    low = max(1, regime.max_new_tokens - regime.length_spread // 2)
    return [low + (i * 37) % width for i in range(num_requests)]


def prompt_pool_size(num_prompts: int, regimes, groups_in_flight: int = GROUPS_IN_FLIGHT) -> int:
    """Distinct prompts the regimes draw from (:func:`regime_prompts`): enough for the widest one."""
    concurrencies = [Regime(*regime).concurrency for regime in regimes]
    return max([num_prompts] + [concurrency * groups_in_flight for concurrency in concurrencies if concurrency > 1])


def with_control(regimes, control: bool) -> list[tuple[Regime, bool]]:
    """``(regime, is_control)`` for each of ``regimes`` (a :class:`Regime` or its fields as a tuple),
    then :data:`CONTROL_REGIME` when ``control``."""
    return [(Regime(*regime), False) for regime in regimes] + ([(Regime(*CONTROL_REGIME), True)] if control else [])


def bench_sweep(engine: Engine, num_prompts: int = 8, prompt_len: int = 64, repeats: int = 3, seed: int = 0,
                regimes=SWEEP_REGIMES, groups_in_flight: int = GROUPS_IN_FLIGHT, keep_in_flight: bool = False,
                control: bool = False) -> list[dict]:
    """Every regime through :func:`bench_engine` on one engine (target-only and speculative interleaved,
    paired repeats); one row per regime with the same-run ratio, its spread over the repeats and the
    speculation policy's drafting share. With several requests in flight a repeat decodes
    ``groups_in_flight`` groups of distinct prompts (:func:`regime_prompts`), each group's requests
    starting together and running to the last one's end, both modes of a group adjacent in time (the
    speculative side ends each group in a thinner batch: its requests finish at different steps).
    ``keep_in_flight``: every such regime's groups are one load instead, a finished request's slot
    going to the next prompt as on a replica under load (its pairs are a whole load apart in time,
    four times a group's), as a :attr:`Regime.refilled` regime always is (left out here: it would
    repeat its closed twin). ``control``: a last row, :data:`CONTROL_REGIME`, whose both sides decode target-only
    (with ``keep_in_flight``, as one load too)."""
    all_regimes = with_control(regimes, control)
    prompts = heldout_prompts(engine, prompt_pool_size(num_prompts, [r for r, _ in all_regimes], groups_in_flight),
                              prompt_len)
    policy = engine.scheduler.policy
    rows = []
    if keep_in_flight:
        all_regimes = [(regime, is_control) for regime, is_control in all_regimes if not regime.refilled]
    for regime, is_control in all_regimes:
        name, concurrency = regime.name, regime.concurrency
        group = regime_prompts(prompts, num_prompts, concurrency, groups_in_flight)
        params = [SamplingParams(**{"max_new_tokens": length, "seed": seed, **regime.overrides})
                  for length in request_lengths(regime, len(group))]
        steps_before = (policy.num_decode_steps, policy.num_drafting_steps) if policy is not None else (0, 0)
        load_size = len(group) if (keep_in_flight or regime.refilled) and concurrency > 1 else concurrency
        report = bench_engine(None, None, params, concurrency=concurrency, engine=engine, prompts=group,
                              repeats=repeats, load_size=load_size, control=is_control)
        share = None
        if policy is not None and not is_control:
            decode = policy.num_decode_steps - steps_before[0]
            share = (policy.num_drafting_steps - steps_before[1]) / decode if decode else 0.0
        rows.append({"regime": name, "num_requests": len(group), "speedup": report.speedup,
                     "run_speedups": report.run_speedups, "request_speedup": report.request_speedup,
                     "request_run_speedups": report.request_speedups,
                     "target_only_tokens_per_s": report.target_only_tokens_per_s,
                     "speculative_tokens_per_s": report.speculative_tokens_per_s,
                     "mean_accepted_len": None if is_control else report.mean_accepted_len,
                     "mean_verified_len": None if is_control else report.mean_verified_len,
                     "drafting_share": share, "identical_greedy_output": report.identical_greedy_output,
                     "interval": report.interval, "num_pairs": len(report.pairs), "control": is_control,
                     "tokens": {side: [sum(getattr(p, f"{side}_tokens") for p in repeat) for repeat in report.repeat_pairs]
                                for side in ("target_only", "speculative")}})
    return rows


def format_sweep(rows: list[dict]) -> str:
    """The sweep as one table (ratios against target-only measured in the same run)."""
    width = max([32] + [len(row["regime"]) for row in rows])  # the regime column fits its longest name
    lines = [f"{'regime':{width}} {'target-only':>12} {'speculative':>12} {'ratio':>7} {'repeats':>11}"
             f" {'95% interval':>13} {'per request':>11} {'accepted':>9} {'verified':>9} {'drafting':>9}  identical",
             "-" * (112 + width)]
    def figure(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    def spread(ratios) -> str:
        return f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "-"

    def interval(row) -> str:
        bounds = row.get("interval")
        return "-" if bounds is None or row.get("num_pairs", 0) < 2 else f"{bounds[0]:.2f}-{bounds[1]:.2f}"

    for row in rows:
        share = "-" if row["drafting_share"] is None else f"{100 * row['drafting_share']:.0f}%"
        identical = "" if row["identical_greedy_output"] is None else str(row["identical_greedy_output"])
        per_request = row.get("request_speedup")
        per_request = "-" if per_request is None else f"{per_request:.2f}x"
        lines.append(f"{row['regime']:{width}} {row['target_only_tokens_per_s']:8.1f} t/s {row['speculative_tokens_per_s']:8.1f}"
                     f" t/s {row['speedup']:6.2f}x {spread(row['run_speedups']):>11} {interval(row):>13}"
                     f" {per_request:>11}"
                     f" {figure(row['mean_accepted_len']):>9} {figure(row['mean_verified_len']):>9}"
                     f" {share:>9}  {identical}")
    regimes = [row for row in rows if not row.get("control")] or rows
    lowest = min(regimes, key=lambda row: row["speedup"])
    lines.append(f"lowest: {lowest['speedup']:.2f}x ({lowest['regime']}); ratio = median of the paired repeats "
                 "(tokens per second of each load, to its last request's end), repeats = their lowest and highest; "
                 "95% interval = bootstrap over the paired groups of their pooled ratio; "
                 "per request = median of the paired ratios of mean request latency (admission to last token); "
                 "drafting = share of the speculative runs' decode steps that drafted")
    verdicts: dict[str, list[str]] = {}
    for row in regimes:
        if row.get("interval") is not None and row.get("num_pairs", 0) >= 2 and not row.get("control"):
            verdicts.setdefault(floor_verdict(row["interval"], SPEED_FLOOR), []).append(row["regime"])
    if verdicts:
        names = {"below": "below it", "undecided": "cannot be told from it", "above": "at or above it"}
        lines.append(f"floor {SPEED_FLOOR:.2f}x by the 95% intervals: " + "; ".join(
            f"{names[v]}: {', '.join(verdicts[v])}" for v in ("below", "undecided", "above") if v in verdicts))
    if any(row.get("control") for row in rows):
        control_regime = Regime(*CONTROL_REGIME)
        overrides, concurrency = control_regime.overrides, control_regime.concurrency
        sampling = ", ".join(f"{k} {v}" for k, v in overrides.items()) or "greedy"
        lines.append(f"control: both sides of each pair decode target-only ({concurrency} in flight, {sampling}); "
                     "its repeats are this machine's own scatter of a paired ratio")
    return "\n".join(lines)
