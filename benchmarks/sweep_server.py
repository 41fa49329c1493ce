"""``dspine bench engine --sweep --through-server``: the sweep's regimes through the standalone gRPC server."""

from __future__ import annotations

import asyncio
import statistics

from .load import run_load
from .paired import Pair, bootstrap_interval, pooled_ratio
from .servers import StandaloneServer
from .sweep import GROUPS_IN_FLIGHT, SWEEP_REGIMES, regime_prompts, request_lengths, with_control


def served_loads(group: list[list[int]], lengths: list[int], concurrency: int,
                 refilled: bool) -> list[tuple[list[list[int]], list[int]]]:
    """The loads one repeat of a served regime streams, each paired on its own (both modes of a load
    adjacent in time), as ``(prompts, their max_new_tokens)``: one per prompt with one in flight, one
    per closed group of ``concurrency`` prompts with several, and the whole ``group`` as one load
    whose streams stay open over all of it (each freed stream takes the next prompt) for a refilled
    regime. ``lengths``: each prompt's own output length (:func:`request_lengths`), cut with it."""
    if len(lengths) != len(group):
        raise ValueError(f"served_loads: {len(lengths)} lengths for {len(group)} prompts")
    if refilled:
        return [(group, lengths)]
    return [(group[i:i + concurrency], lengths[i:i + concurrency]) for i in range(0, len(group), concurrency)]


def bench_sweep_server(prompts: list[list[int]], num_prompts: int = 8, repeats: int = 3, seed: int = 0, regimes=None,
                       threads: int = 2, target_dir=None, draft_dir=None, sampled_draft_dir=None,
                       groups_in_flight: int = GROUPS_IN_FLIGHT, keep_in_flight: bool = False,
                       control: bool = False) -> list[dict]:
    """``dspine bench engine --sweep`` through the standalone gRPC server (a subprocess, streamed
    through the SDK): per regime, target-only (``speculative=False``) and speculative requests of
    the same prompts, ``repeats`` times over the regime's loads (:func:`served_loads`), both modes of
    each load adjacent in time and in alternating order. A repeat's ratio pools its loads' pairs
    (as the inline sweep pools a repeat's prompts or groups); the row's ratio is the median over
    the repeats, its interval a bootstrap over every pair. Rows as
    :func:`dspine.benchmarks.sweep.bench_sweep`'s (the policy's counters live in the server, so
    acceptance and drafting share are not reported). ``prompts`` is the pool
    :func:`dspine.benchmarks.sweep.regime_prompts` draws each regime's requests from.
    ``keep_in_flight``: every regime with several in flight streams its prompts as one load (a
    refilled regime, its twin then, is left out), as with the inline sweep's. ``control``: a
    last row, :data:`~dspine.benchmarks.sweep.CONTROL_REGIME`, whose both sides stream target-only."""
    # A pair was once a whole load of every request of the regime (32 of them at 8 in flight, 3.5 s
    # a side): five such pairs of the control row, target-only on both sides, spanned 0.88-1.14x,
    # wider than any gap the sweep is there to judge. A pair per prompt or per group of 8 keeps both
    # sides of a pair within a few seconds of each other, as the inline sweep's pairs are.
    server = StandaloneServer(threads, 8, target_dir, draft_dir, sampled_draft_dir)
    rows = []
    try:
        asyncio.run(run_load(server.address, "warm", prompts[:1], 1,
                             dict(max_new_tokens=4, ignore_eos=True, speculative=True)))
        all_regimes = with_control(SWEEP_REGIMES if regimes is None else regimes, control)
        if keep_in_flight:
            all_regimes = [(regime, is_control) for regime, is_control in all_regimes if not regime.refilled]
        for regime, is_control in all_regimes:
            name, concurrency = regime.name, regime.concurrency
            group = regime_prompts(prompts, num_prompts, concurrency, groups_in_flight)
            loads = served_loads(group, request_lengths(regime, len(group)), concurrency,
                                 regime.refilled or (keep_in_flight and concurrency > 1))
            sampling = dict(max_new_tokens=regime.max_new_tokens, seed=seed, ignore_eos=True, **regime.overrides)
            pairs: list[Pair] = []
            repeat_pairs: list[list[Pair]] = []
            latencies: dict[bool, list[float]] = {False: [], True: []}  # per repeat: mean request latency
            for repeat in range(repeats):
                this_repeat: list[Pair] = []
                repeat_latencies: dict[bool, list[float]] = {False: [], True: []}
                for index, (load, load_lengths) in enumerate(loads):
                    seconds, tokens = {}, {}
                    order = (False, True) if (repeat + index) % 2 == 0 else (True, False)
                    for speculative in order:
                        report = asyncio.run(run_load(server.address, name, load, concurrency,
                                                      {**sampling, "speculative": speculative and not is_control},
                                                      max_new_tokens=load_lengths))
                        if report.errors:
                            raise RuntimeError(f"{name}: requests failed through the server: {dict(report.errors)}")
                        seconds[speculative], tokens[speculative] = report.wall_s, report.tokens
                        repeat_latencies[speculative] += report.latencies_s
                    this_repeat.append(Pair(seconds[False], seconds[True], tokens[False], tokens[True]))
                pairs += this_repeat
                repeat_pairs.append(this_repeat)
                for speculative in (False, True):
                    latencies[speculative].append(statistics.fmean(repeat_latencies[speculative]))
            ratios = [pooled_ratio(repeat) for repeat in repeat_pairs]
            request_ratios = [base / spec for base, spec in zip(latencies[False], latencies[True])]
            rates = {side: [sum(getattr(p, f"{side}_tokens") for p in repeat)
                            / sum(getattr(p, f"{side}_seconds") for p in repeat) for repeat in repeat_pairs]
                     for side in ("target_only", "speculative")}
            rows.append({"regime": name, "num_requests": len(group), "speedup": statistics.median(ratios),
                         "run_speedups": ratios, "request_speedup": statistics.median(request_ratios),
                         "request_run_speedups": request_ratios,
                         "target_only_tokens_per_s": statistics.median(rates["target_only"]),
                         "speculative_tokens_per_s": statistics.median(rates["speculative"]),
                         "mean_accepted_len": None, "mean_verified_len": None, "drafting_share": None,
                         "identical_greedy_output": None, "interval": bootstrap_interval(pairs),
                         "num_pairs": len(pairs), "pair_speedups": [p.ratio for p in pairs], "control": is_control,
                         "tokens": {"target_only": [sum(p.target_only_tokens for p in repeat) for repeat in repeat_pairs],
                                    "speculative": [sum(p.speculative_tokens for p in repeat) for repeat in repeat_pairs]}})
    finally:
        server.close()
    return rows
