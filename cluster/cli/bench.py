"""``dspine bench target|engine|prefill|cluster``: benchmarks, each printing ratios against a baseline
measured in the same run."""

from __future__ import annotations

import json
import sys

from .options import add_model_args, add_sampling_args, engine_config, sampling_from_args


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks (ratios against a baseline measured in the same run)")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    bench_target = bench_kinds.add_parser("target", help="target-only decode tokens/s: ours vs transformers")
    add_model_args(bench_target)
    bench_target.add_argument("--prompt-len", type=int, default=32)
    bench_target.add_argument("--new-tokens", type=int, default=64)
    bench_target.add_argument("--repeats", type=int, default=3)
    bench_engine = bench_kinds.add_parser("engine", help="speculative vs target-only decoding on the same prompts")
    add_model_args(bench_engine)
    add_sampling_args(bench_engine)
    bench_engine.add_argument("--num-prompts", type=int, default=8)
    bench_engine.add_argument("--prompt-len", type=int, default=64)
    bench_engine.add_argument("--concurrency", type=int, default=1)
    bench_engine.add_argument("--repeats", type=int, default=3, help="paired target-only / speculative runs")
    bench_engine.add_argument("--json", action="store_true")
    bench_engine.add_argument("--trace-out", help="write the first repeat's engine steps as a Chrome/Perfetto "
                                                  "trace (JSON; open in ui.perfetto.dev)")
    bench_engine.add_argument("--sweep", action="store_true",
                              help="run the regimes of the speculation policy (greedy, first 48 tokens, sampled, "
                                   "8 in flight), target-only and speculative interleaved, and print one table")
    bench_engine.add_argument("--groups-in-flight", type=int, default=None, metavar="N",
                              help="with --sweep: groups of 8 distinct prompts each repeat decodes in the "
                                   "8-in-flight regimes (default 4)")
    bench_engine.add_argument("--keep-in-flight", action="store_true",
                              help="with --sweep: the 8-in-flight regimes decode their groups' prompts as one load "
                                   "that keeps 8 in flight (a finished request's slot goes to the next prompt), "
                                   "not group by group, as on a replica under load (the sweep's refilled row "
                                   "always does; it is left out then)")
    bench_engine.add_argument("--no-control", action="store_true",
                              help="with --sweep: leave out the control row (both sides of each pair target-only, "
                                   "8 in flight: the machine's own scatter of a paired ratio)")
    bench_engine.add_argument("--plot", metavar="FILE.png",
                              help="also draw the accepted-length histogram and the per-token stage costs beside "
                                   "target-only (needs the plot extra: matplotlib)")
    bench_engine.add_argument("--through-server", action="store_true",
                              help="with --sweep: also run the sweep through the standalone gRPC server "
                                   "(a subprocess, streamed through the SDK)")
    bench_engine.add_argument("--kv-layouts", type=int, nargs="?", const=1024, default=None, metavar="PROMPT_LEN",
                              help="the target's K/V layouts (contiguous vs paged) in one run: --num-prompts "
                                   "requests in flight with PROMPT_LEN-token prompts (default 1024), "
                                   "target-only and speculative decode throughput, --repeats paired repeats")
    bench_engine.add_argument("--tracing", action="store_true",
                              help="also measure decode time with tracing on vs off (paired, same run)")
    bench_prefill = bench_kinds.add_parser("prefill", help="peak activation memory of a long prefill: chunked vs "
                                                          "unchunked (same run)")
    bench_prefill.add_argument("--target", help="HF-format target directory (default: the embedded target)")
    bench_prefill.add_argument("--draft", help="DSpine draft directory (default: the embedded drafter)")
    bench_prefill.add_argument("--prompt-len", type=int, default=4096)
    bench_prefill.add_argument("--chunk", type=int, default=512, help="prefill_chunk_tokens of the chunked run")
    bench_prefill.add_argument("--no-spec", action="store_true", help="target-only (no drafter context)")
    bench_prefill.add_argument("--json", action="store_true")
    bench_cluster = bench_kinds.add_parser("cluster", help="the serving path (standalone server, Ray cluster with "
                                                           "1 and 2 replicas) vs the engine inline")
    bench_cluster.add_argument("--num-prompts", type=int, default=8)
    bench_cluster.add_argument("--prompt-len", type=int, default=64)
    bench_cluster.add_argument("--new-tokens", type=int, default=96)
    bench_cluster.add_argument("--temperature", type=float, default=0.0)
    bench_cluster.add_argument("--seed", type=int, default=0)
    bench_cluster.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every phase")
    bench_cluster.add_argument("--concurrency", type=int, default=16, help="streams in flight in the load phase")
    bench_cluster.add_argument("--requests", type=int, default=48, help="requests of the load phase")
    bench_cluster.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    bench_cluster.add_argument("--json", action="store_true")
    bench_target.set_defaults(handler=cmd_bench_target)
    bench_engine.set_defaults(handler=cmd_bench_engine)
    bench_prefill.set_defaults(handler=cmd_bench_prefill)
    bench_cluster.set_defaults(handler=cmd_bench_cluster)


def cmd_bench_cluster(args) -> int:
    from dspine.benchmarks.cluster import bench_cluster, format_report

    result = bench_cluster(num_prompts=args.num_prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                           temperature=args.temperature, seed=args.seed, rounds=args.rounds,
                           concurrency=args.concurrency, num_requests=args.requests, threads=args.threads)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


def cmd_bench_prefill(args) -> int:
    from dspine.benchmarks.prefill import bench_prefill, format_report

    from ..embedded import resolve_model_dirs

    target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed=not args.no_spec)
    result = bench_prefill(target_dir, None if args.no_spec else draft_dir, prompt_len=args.prompt_len,
                           chunk=args.chunk, speculative=not args.no_spec)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


def cmd_bench_target(args) -> int:
    from dspine.benchmarks.transformers_baseline import bench_target

    from ..embedded import resolve_model_dirs

    target_dir, _ = resolve_model_dirs(args.target, None, speculative_needed=False)
    report = bench_target(target_dir, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                          repeats=args.repeats, device=args.device)
    print(report.format())
    return 0


def cmd_bench_engine(args) -> int:
    from ..embedded import resolve_model_dirs

    target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed=True)
    if args.kv_layouts is not None:
        return _bench_kv_layouts(args, target_dir, draft_dir)
    if args.sweep:
        return _bench_sweep(args, target_dir, draft_dir)
    return _bench_engine(args, target_dir, draft_dir)


def _sampled_draft_dir(args) -> str | None:
    """--sampled-draft, or the embedded sampled drafter beside the embedded pair (when shipped)."""
    from ..embedded import resolve_sampled_draft_dir

    return resolve_sampled_draft_dir(args.target, args.draft, args.sampled_draft)


def _bench_kv_layouts(args, target_dir: str, draft_dir: str) -> int:
    from dspine.benchmarks.kv_layouts import bench_kv_layouts, format_kv_layouts

    report = bench_kv_layouts(target_dir, draft_dir, num_requests=args.num_prompts, prompt_len=args.kv_layouts,
                              new_tokens=args.max_new_tokens, repeats=args.repeats, device=args.device,
                              dtype=args.dtype, adaptive=not args.no_adaptive)
    print(json.dumps(report, indent=2) if args.json else format_kv_layouts(report))
    return 0


def _bench_sweep(args, target_dir: str, draft_dir: str) -> int:
    from dspine.benchmarks.prompts import heldout_prompts
    from dspine.benchmarks.sweep import GROUPS_IN_FLIGHT, SWEEP_REGIMES, bench_sweep, format_sweep, prompt_pool_size
    from dspine.replica import Engine
    from dspine.replica.gc_freeze import freeze_after_load

    # One engine for every phase: a second engine's thread would slow both (replica/device_thread.py).
    engine = Engine.from_pretrained(target_dir, draft_dir, engine_config(args, max_concurrency=8),
                                    sampled_draft_dir=_sampled_draft_dir(args))
    freeze_after_load()
    seed = 0 if args.seed is None else args.seed
    groups = GROUPS_IN_FLIGHT if args.groups_in_flight is None else args.groups_in_flight
    if groups < 1:
        raise SystemExit(f"--groups-in-flight: must be >= 1, got {groups}")
    rows = bench_sweep(engine, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                       repeats=args.repeats, seed=seed, groups_in_flight=groups,
                       keep_in_flight=args.keep_in_flight, control=not args.no_control)
    served = None
    if args.through_server:
        from dspine.benchmarks.sweep_server import bench_sweep_server

        pool = heldout_prompts(engine, prompt_pool_size(args.num_prompts, SWEEP_REGIMES, groups), args.prompt_len)
        served = bench_sweep_server(pool, num_prompts=args.num_prompts, repeats=args.repeats, seed=seed,
                                    target_dir=target_dir, draft_dir=draft_dir,
                                    sampled_draft_dir=_sampled_draft_dir(args), groups_in_flight=groups,
                                    keep_in_flight=args.keep_in_flight, control=not args.no_control)
    if args.json:
        print(json.dumps(rows if served is None else {"inline": rows, "server": served}, indent=2))
    else:
        print(format_sweep(rows))
        if served is not None:
            print("\nthrough the standalone gRPC server (SDK streaming, same prompts):")
            print(format_sweep(served))
    return 0


def _bench_engine(args, target_dir: str, draft_dir: str) -> int:
    if args.plot:  # before minutes of benchmarking, not after
        from dspine.benchmarks.plot import PlotUnavailableError, require_pyplot

        try:
            require_pyplot()
        except PlotUnavailableError as e:
            print(f"dspine bench: error: {e}", file=sys.stderr)
            return 2
    from dspine.benchmarks.engine import bench_engine
    from dspine.benchmarks.prompts import heldout_prompts
    from dspine.replica import Engine, SamplingParams
    from dspine.replica.gc_freeze import freeze_after_load

    # One engine for every phase: a second engine's thread would slow both (replica/device_thread.py).
    engine = Engine.from_pretrained(target_dir, draft_dir,
                                    engine_config(args, max_concurrency=max(args.concurrency, 1)),
                                    sampled_draft_dir=_sampled_draft_dir(args))
    freeze_after_load()
    report = bench_engine(target_dir, draft_dir, sampling_from_args(args), num_prompts=args.num_prompts,
                          prompt_len=args.prompt_len, concurrency=args.concurrency, repeats=args.repeats,
                          engine=engine, trace_out=args.trace_out)
    overhead = None
    if args.tracing:
        from dspine.benchmarks.tracing_overhead import bench_tracing_overhead

        sampling = sampling_from_args(args)
        prompts = heldout_prompts(engine, args.num_prompts, args.prompt_len)
        overhead = bench_tracing_overhead(engine, prompts, SamplingParams(
            **{**sampling.__dict__, "ignore_eos": True}), repeats=args.repeats)
    if args.json:
        print(json.dumps({**report.as_dict(), **({"tracing": overhead} if overhead else {})}, indent=2))
    else:
        print(report.format())
        if overhead:
            print(f"tracing on / off (decode time per request, median of {overhead['pairs']} pairs): "
                  f"{overhead['tracing_on_vs_off_median']:.4f}x ({overhead['on_median_s'] * 1000:.1f} vs "
                  f"{overhead['off_median_s'] * 1000:.1f} ms)")
        if args.trace_out:
            print(f"wrote {args.trace_out} (open in ui.perfetto.dev)")
    if args.plot:
        from dspine.benchmarks.plot import plot_engine_bench

        plot_engine_bench(report, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0
