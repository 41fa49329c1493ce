"""``dspine bench engine --sweep --through-server``: the sweep's regimes through the standalone gRPC server."""

from __future__ import annotations

import asyncio
import statistics

from .load import run_load
from .paired import Pair, bootstrap_interval
from .servers import StandaloneServer
from .sweep import GROUPS_IN_FLIGHT, SWEEP_REGIMES, regime_prompts, with_control


def bench_sweep_server(prompts: list[list[int]], num_prompts: int = 8, repeats: int = 3, seed: int = 0, regimes=None,
                       threads: int = 2, target_dir=None, draft_dir=None, sampled_draft_dir=None,
                       groups_in_flight: int = GROUPS_IN_FLIGHT, control: bool = False) -> list[dict]:
    """``dspine bench engine --sweep`` through the standalone gRPC server (a subprocess, streamed
    through the SDK): per regime, target-only (``speculative=False``) and speculative requests of
    the same prompts, interleaved with alternating order, ``repeats`` paired runs; the ratio is the
    median of the paired ratios, the interval a bootstrap over the repeats' pairs (a pair is a whole
    load here, so with few repeats the interval is little more than their spread). Rows as
    :func:`dspine.benchmarks.sweep.bench_sweep`'s (the policy's counters live in the server, so
    acceptance and drafting share are not reported). ``prompts`` is
    the pool :func:`dspine.benchmarks.sweep.regime_prompts` draws each regime's requests from: with
    several in flight, the load keeps ``concurrency`` streams open over all of them (so refilled
    regimes are left out). ``control``: a
    last row, :data:`~dspine.benchmarks.sweep.CONTROL_REGIME`, whose both sides stream target-only."""
    # Served loads keep their streams open over all their requests, so every one is refilled: a
    # refilled regime would repeat its twin.
    regimes = [(regime, is_control) for regime, is_control
               in with_control(SWEEP_REGIMES if regimes is None else regimes, control) if not regime.refilled]
    server = StandaloneServer(threads, 8, target_dir, draft_dir, sampled_draft_dir)
    rows = []
    try:
        asyncio.run(run_load(server.address, "warm", prompts[:1], 1,
                             dict(max_new_tokens=4, ignore_eos=True, speculative=True)))
        for (name, overrides, max_new_tokens, concurrency, _), is_control in regimes:
            group = regime_prompts(prompts, num_prompts, concurrency, groups_in_flight)
            sampling = dict(max_new_tokens=max_new_tokens, seed=seed, ignore_eos=True, **overrides)
            seconds: dict[bool, list[float]] = {False: [], True: []}
            tokens: dict[bool, list[int]] = {False: [], True: []}
            latencies: dict[bool, list[float]] = {False: [], True: []}  # per run: mean request latency
            for repeat in range(repeats):
                for speculative in ((False, True) if repeat % 2 == 0 else (True, False)):
                    report = asyncio.run(run_load(server.address, name, group, concurrency,
                                                  {**sampling, "speculative": speculative and not is_control}))
                    if report.errors:
                        raise RuntimeError(f"{name}: requests failed through the server: {dict(report.errors)}")
                    seconds[speculative].append(report.wall_s)
                    tokens[speculative].append(report.tokens)
                    latencies[speculative].append(statistics.fmean(report.latencies_s))
            pairs = [Pair(*sides) for sides in zip(seconds[False], seconds[True], tokens[False], tokens[True])]
            ratios = [pair.ratio for pair in pairs]
            request_ratios = [base / spec for base, spec in zip(latencies[False], latencies[True])]
            rows.append({"regime": name, "num_requests": len(group), "speedup": statistics.median(ratios),
                         "run_speedups": ratios, "request_speedup": statistics.median(request_ratios),
                         "request_run_speedups": request_ratios,
                         "target_only_tokens_per_s": statistics.median(p.target_only_tokens / p.target_only_seconds
                                                                       for p in pairs),
                         "speculative_tokens_per_s": statistics.median(p.speculative_tokens / p.speculative_seconds
                                                                       for p in pairs),
                         "mean_accepted_len": None, "mean_verified_len": None, "drafting_share": None,
                         "identical_greedy_output": None, "interval": bootstrap_interval(pairs),
                         "num_pairs": len(pairs), "control": is_control,
                         "tokens": {"target_only": tokens[False], "speculative": tokens[True]}})
    finally:
        server.close()
    return rows
