"""The ``dspine`` command line.

    dspine generate --prompt TEXT [--target DIR --draft DIR] [--no-spec] [--json] [--server HOST:PORT]
    dspine serve [--replicas N] [--port 9000] [--config FILE] [--address ADDR]   # the Ray Serve cluster
    dspine serve --standalone [--target DIR --draft DIR] [--host H --port P] [--max-concurrency N]
    dspine status [--address ADDR] [--app NAME] [--json]
    dspine deploy FILE [--check] [--address URL]
    dspine info --draft-preset dspine-27b-b16
    dspine plan [--target-preset NAME | --target DIR] [--draft-preset NAME | --draft DIR] [--device-memory 141GB]
                [--max-concurrency 8] [--max-seq-len 8192] [--draft-pool dense|ring]   # exit 1: does not fit
    dspine bench target | engine | prefill | cluster
    dspine train target | draft

Without ``--target`` the embedded tiny trained pair is used. Heavy imports
happen inside the command that needs them, so ``dspine --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="HF-format target directory (default: the embedded tiny target)")
    parser.add_argument("--draft", help="DSpine draft directory (default: the embedded drafter when --target is not given)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto")
    parser.add_argument("--verify-threshold", type=float, default=None,
                        help="dynamic verification: verify a draft row while the drafter's confidence product "
                             "is >= this (0: the whole block; default: the engine's)")
    parser.add_argument("--retrieval", default="auto", choices=["auto", "exact", "fp8", "bf16"],
                        help="the tail's candidate retrieval (auto: fp8 on cuda, bf16 on CPUs with native bf16)")
    parser.add_argument("--no-adaptive", action="store_true",
                        help="draft every step for every speculative request (adaptive speculation off)")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= MIN_P * max p (0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="(vLLM's; 1: off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (0: off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (0: off)")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                        help="add BIAS in [-100, 100] to a token's logit (repeatable)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="print each token's logprob and the top N alternatives")
    parser.add_argument("--reproducible", action="store_true",
                        help="with --seed: the same tokens with speculation on or off and in any batch")


def _logit_bias_from_args(args) -> dict[int, float]:
    bias = {}
    for item in getattr(args, "logit_bias", []):
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise SystemExit(f"dspine: error: --logit-bias: expected TOKEN_ID=BIAS, got {item!r}") from None
        if not sep:
            raise SystemExit(f"dspine: error: --logit-bias: expected TOKEN_ID=BIAS, got {item!r}")
    return bias


def _option_args(args) -> dict:
    """The request options shared by the local engine and the SDK (vLLM's names)."""
    return dict(min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, logit_bias=_logit_bias_from_args(args),
                logprobs=args.logprobs, reproducible=args.reproducible)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspine", description="DSpine speculative decoding serving stack")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text with the engine (or a server)")
    _add_model_args(generate)
    _add_sampling_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--no-spec", action="store_true", help="target-only decoding")
    generate.add_argument("--json", action="store_true", help="print a JSON object")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--server", help="HOST:PORT of a dspine gRPC server instead of a local engine")
    generate.add_argument("--trace", action="store_true",
                          help="with --server: trace the call (OTLP export from OTEL_EXPORTER_OTLP_ENDPOINT) and "
                               "print its trace id")

    serve = commands.add_parser("serve", help="serve the gRPC API on a Ray Serve cluster (--standalone: one "
                                              "engine, no Ray)")
    _add_model_args(serve)
    serve.add_argument("--standalone", action="store_true", help="one engine in this process, no Ray")
    serve.add_argument("--host", default="127.0.0.1", help="--standalone: interface to bind")
    serve.add_argument("--port", type=int, default=None,
                       help="gRPC port (default: 9000 for the cluster, 50051 standalone; 0: any free port, "
                            "standalone only)")
    serve.add_argument("--max-concurrency", type=int, default=None, help="requests in flight per replica (default 8)")
    serve.add_argument("--replicas", type=int, default=None, help="engine replicas (cluster; default 1)")
    serve.add_argument("--num-cpus", type=float, default=None,
                       help="CPUs (and torch threads) per replica (cluster; default 1)")
    serve.add_argument("--num-gpus", type=float, default=None, help="GPUs per replica (cluster; 1 on GPU nodes)")
    serve.add_argument("--max-queued", type=int, default=None,
                       help="requests that may wait for a slot before RESOURCE_EXHAUSTED (cluster)")
    serve.add_argument("--request-timeout", type=float, default=None, help="seconds, queueing included (cluster)")
    serve.add_argument("--http-port", type=int, default=None, help="Serve's HTTP proxy port (cluster)")
    serve.add_argument("--config", help="a serve-config YAML whose dspine application's args are the base "
                                        "(flags override them)")
    serve.add_argument("--address", help="join this Ray cluster (e.g. auto) instead of starting a local one; "
                                         "deploys and returns")
    serve.add_argument("--max-seq-len", type=int, default=None, help="context (prompt + output) per request")
    serve.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key: TLS)")
    serve.add_argument("--tls-key", help="PEM private key")
    serve.add_argument("--auth-token", help="require 'authorization: Bearer TOKEN' on every call")

    status = commands.add_parser("status", help="the cluster's replicas: load, peak in flight, health")
    status.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    status.add_argument("--app", default="dspine", help="application name")
    status.add_argument("--json", action="store_true")

    deploy = commands.add_parser("deploy", help="strictly check a serve-config YAML, then `serve deploy` it")
    deploy.add_argument("config", help="serve-config YAML (e.g. the shipped cluster/serve_config.yaml)")
    deploy.add_argument("--check", action="store_true", help="only check, do not deploy")
    deploy.add_argument("--address", help="Ray dashboard address for serve deploy (default: its own)")

    info = commands.add_parser("info", help="print a drafter preset's memory report")
    info.add_argument("--draft-preset", default="dspine-27b-b16")

    plan = commands.add_parser("plan", help="the memory plan of a target + drafter on one device (exit 1: does "
                                            "not fit)")
    plan.add_argument("--target-preset", default="Qwen3.8-27B", help="target preset (default: the 27B reference)")
    plan.add_argument("--target", help="HF-format target directory (its config.json; overrides --target-preset)")
    plan.add_argument("--draft-preset", default="dspine-27b-b16", help="drafter preset")
    plan.add_argument("--draft", help="DSpine draft directory (its config.json; overrides --draft-preset)")
    plan.add_argument("--no-draft", action="store_true", help="target only")
    plan.add_argument("--device-memory", default="141GB", help="device memory: 141GB, 139GiB or bytes")
    plan.add_argument("--max-concurrency", type=int, default=8)
    plan.add_argument("--max-seq-len", type=int, default=8192, help="context (prompt + output) per request")
    plan.add_argument("--draft-pool", default="dense", choices=["dense", "ring"])
    plan.add_argument("--draft-pool-tokens", type=int, default=None, help="draft pool slots (default: every request "
                                                                          "at its largest)")
    plan.add_argument("--dtype-bytes", type=int, default=2, help="bytes per target element (2: BF16)")
    plan.add_argument("--retrieval", default="fp8", choices=["fp8", "bf16", "exact"])
    plan.add_argument("--prefill-chunk-tokens", type=int, default=4096)
    plan.add_argument("--verify-keeps", default="inputs", choices=["inputs", "states"],
                      help="what a verify keeps per GDN position for the prefix commit")
    plan.add_argument("--reserved", default="0", help="memory kept off the plan (CUDA context, slack), e.g. 2GiB")
    plan.add_argument("--json", action="store_true")

    bench = commands.add_parser("bench", help="benchmarks (ratios against a baseline measured in the same run)")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    bench_target = bench_kinds.add_parser("target", help="target-only decode tokens/s: ours vs transformers")
    _add_model_args(bench_target)
    bench_target.add_argument("--prompt-len", type=int, default=32)
    bench_target.add_argument("--new-tokens", type=int, default=64)
    bench_target.add_argument("--repeats", type=int, default=3)
    bench_engine = bench_kinds.add_parser("engine", help="speculative vs target-only decoding on the same prompts")
    _add_model_args(bench_engine)
    _add_sampling_args(bench_engine)
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
    train = commands.add_parser("train", help="train the embedded pair from scratch (CPU-friendly, seeded)")
    train_kinds = train.add_subparsers(dest="train", required=True)
    train_target = train_kinds.add_parser("target", help="tokenizer + tiny hybrid target on the stdlib corpus")
    train_target.add_argument("--out", required=True, help="output HF-format directory")
    train_target.add_argument("--steps", type=int, default=2000)
    train_target.add_argument("--batch-size", type=int, default=16)
    train_target.add_argument("--seq-len", type=int, default=256)
    train_target.add_argument("--seed", type=int, default=0)
    train_target.add_argument("--max-files", type=int, default=None, help="limit the corpus (quick pipeline checks)")
    train_draft = train_kinds.add_parser("draft", help="distil a DSpine drafter from a frozen target")
    train_draft.add_argument("--target", required=True, help="trained target directory")
    train_draft.add_argument("--out", required=True, help="output DSpine draft directory")
    # None -> DraftTrainConfig's default (the shipped drafter's recipe), so the two never drift apart.
    train_draft.add_argument("--steps", type=int, default=None)
    train_draft.add_argument("--seed", type=int, default=None)
    train_draft.add_argument("--max-files", type=int, default=None)
    train_draft.add_argument("--num-sequences", type=int, default=None,
                             help="target-greedy continuations to distil from")
    train_draft.add_argument("--threads", type=int, default=None,
                             help="torch threads (1 makes the run bit-reproducible on one machine)")
    return parser


def cmd_train(args) -> int:
    if args.train == "target":
        from dspine.training.target import TargetTrainConfig, train_target

        train_target(TargetTrainConfig(out_dir=args.out, steps=args.steps, batch_size=args.batch_size,
                                       seq_len=args.seq_len, seed=args.seed, max_files=args.max_files))
        return 0
    from dspine.training.draft import DraftTrainConfig, train_draft

    given = {"steps": args.steps, "seed": args.seed, "max_files": args.max_files,
             "num_sequences": args.num_sequences, "threads": args.threads}
    train_draft(DraftTrainConfig(target_dir=args.target, out_dir=args.out,
                                 **{k: v for k, v in given.items() if v is not None}))
    return 0


def _engine_from_args(args, speculative_needed: bool = True):
    from dspine.replica import Engine

    from .embedded import resolve_model_dirs

    target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed)
    return Engine.from_pretrained(target_dir, draft_dir, _engine_config(args))


def _engine_config(args, **extra):
    from dspine.replica import EngineConfig

    knobs = dict(device=args.device, dtype=args.dtype, retrieval=args.retrieval, **extra)
    if getattr(args, "no_adaptive", False):
        knobs["adaptive_speculation"] = False
    if args.verify_threshold is not None:
        knobs["verify_threshold"] = args.verify_threshold
    return EngineConfig(**knobs)


def _sampling_from_args(args, stop=()):
    from dspine.replica import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              max_new_tokens=args.max_new_tokens, stop=tuple(stop), **_option_args(args))
    except ValueError as e:  # names the field: "min_p: must be in [0, 1] ..."
        raise SystemExit(f"dspine: error: {e}") from None


def cmd_generate(args) -> int:
    if args.server:
        import contextlib

        from .client import DSpineClient

        span = contextlib.nullcontext()
        if args.trace:
            from opentelemetry import trace

            from . import tracing

            tracing.configure("dspine-cli", processors=None if tracing.exporting_env() else [])
            span = trace.get_tracer("dspine.cli").start_as_current_span("dspine generate")
        with span as root, DSpineClient(args.server) as client:
            result = client.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                                     speculative=not args.no_spec, **_option_args(args))
            if args.trace:
                print(f"trace id: {root.get_span_context().trace_id:032x}", file=sys.stderr)
        if args.trace:
            from opentelemetry import trace

            provider = trace.get_tracer_provider()
            if hasattr(provider, "force_flush"):
                provider.force_flush()  # the spans leave before the process exits
        text, token_ids, finish_reason = result.text, result.token_ids, result.finish_reason
        spec = result.speculation
        extra = {  # the figures a local run prints, from the server's final message
            "speculative": spec.speculative,
            "cycles": spec.cycles,
            "mean_accepted_len": round(spec.mean_accepted_len, 3),
            "decode_tokens_per_s": round(result.decode_tokens_per_second, 1),
        }
        logprobs = [(e.token_id, e.logprob, e.top) for e in result.logprobs or []]
    else:
        engine = _engine_from_args(args, speculative_needed=not args.no_spec)
        params = _sampling_from_args(args, args.stop)
        if not args.prompt:  # the server's rule and words (cluster/validation.py validate_text)
            from dspine.replica.errors import InvalidRequestError

            raise InvalidRequestError("text", "must not be empty")
        result = engine.generate_text(args.prompt, params, speculative=False if args.no_spec else None)
        text, token_ids, finish_reason = result.text, result.token_ids, result.finish_reason
        stats = result.stats
        extra = {
            "speculative": stats.speculative,
            "cycles": stats.spec.num_cycles if stats.spec else 0,
            "mean_accepted_len": round(stats.spec.mean_accepted_len, 3) if stats.spec else 0.0,
            "decode_tokens_per_s": round(stats.decode_tokens_per_second, 1),
        }
        logprobs = [(e.token_id, e.logprob, e.top) for e in result.logprobs or []]
    if args.logprobs is not None:
        extra["logprobs"] = [{"token_id": t, "logprob": round(lp, 6), "top": [[i, round(v, 6)] for i, v in top]}
                             for t, lp, top in logprobs]
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "finish_reason": finish_reason, **extra}))
    else:
        print(args.prompt + (text or ""))
        entries = extra.pop("logprobs", None)
        if extra:
            print(f"\n[{finish_reason}; " + ", ".join(f"{k}={v}" for k, v in extra.items()) + "]", file=sys.stderr)
        for entry in entries or []:
            top = " ".join(f"{i}:{v:.4f}" for i, v in entry["top"])
            print(f"token {entry['token_id']} logprob {entry['logprob']:.4f}" + (f"  top {top}" if top else ""),
                  file=sys.stderr)
    return 0


def cluster_config_from_args(args):
    """The :class:`ClusterConfig` of ``dspine serve``: the --config file's args (or the defaults),
    with the flags given on top."""
    from .config import ClusterConfig
    from .serve_config import cluster_config_of, load_serve_config

    base = cluster_config_of(load_serve_config(args.config)) if args.config else ClusterConfig()
    data = base.model_dump()
    if args.port is not None:
        data["grpc_port"] = args.port
    if args.http_port is not None:
        data["http_port"] = args.http_port
    if args.request_timeout is not None:
        data["request_timeout_s"] = args.request_timeout
    if args.target is not None:
        data["model"].update(target_dir=args.target, draft_dir=args.draft)
    elif args.draft is not None:
        data["model"]["draft_dir"] = args.draft
    engine = data["engine"]
    if args.max_concurrency is not None:
        engine["max_concurrency"] = args.max_concurrency
    if args.max_seq_len is not None:
        engine["max_seq_len"] = args.max_seq_len
    for flag, key in (("device", "device"), ("dtype", "dtype"), ("retrieval", "retrieval")):
        if getattr(args, flag) != "auto":
            engine[key] = getattr(args, flag)
    if args.verify_threshold is not None:
        engine["verify_threshold"] = args.verify_threshold
    replicas = data["replicas"]
    for flag, key in (("replicas", "num_replicas"), ("num_cpus", "num_cpus"), ("num_gpus", "num_gpus"),
                      ("max_queued", "max_queued_requests")):
        if getattr(args, flag) is not None:
            replicas[key] = getattr(args, flag)
    return ClusterConfig.model_validate(data)


def cmd_serve_cluster(args) -> int:
    import signal
    import threading

    from .launch import start_cluster

    if args.port == 0:
        raise ValueError("--port 0 is for --standalone; Serve's gRPC proxy needs a fixed port")
    if args.tls_cert or args.tls_key or args.auth_token:
        raise ValueError("--tls-cert/--tls-key/--auth-token are for --standalone: Serve's gRPC proxy has no TLS "
                         "or auth; terminate them in front of the cluster (see README)")
    config = cluster_config_from_args(args)
    print(f"dspine: starting the cluster ({config.replicas.num_replicas} engine replicas)...", file=sys.stderr,
          flush=True)
    start_cluster(config, address=args.address)
    endpoint = f"127.0.0.1:{config.grpc_port}"
    print(f"dspine: cluster serving dspine.v1 on {endpoint}", flush=True)
    print(f"  try: dspine generate --server {endpoint} --prompt 'def fibonacci(n):' --max-new-tokens 64", flush=True)
    print("  status: dspine status", flush=True)
    if args.address:
        return 0  # the cluster outlives this command
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    from ray import serve

    print("dspine: shutting down (in-flight requests may finish)", file=sys.stderr, flush=True)
    serve.shutdown()
    return 0


def cmd_status(args) -> int:
    from .launch import SERVE_NAMESPACE, format_status, replica_loads, use_ray_token_auth

    use_ray_token_auth()  # before Ray is imported: it reads RAY_AUTH_MODE once
    import ray
    from ray import serve

    ray.init(address=args.address, namespace=SERVE_NAMESPACE, log_to_driver=False, logging_level="ERROR")
    applications = serve.status().applications
    app = applications.get(args.app)
    app_status = app.status.value if app is not None else "NOT DEPLOYED"
    loads = replica_loads(args.app)
    if args.json:
        print(json.dumps({"application": args.app, "status": app_status, "replicas": loads}, indent=2))
    else:
        print(format_status(args.app, app_status, loads))
    return 0 if app is not None else 1


def cmd_deploy(args) -> int:
    from .launch import serve_deploy
    from .serve_config import load_serve_config

    load_serve_config(args.config)  # raises ValueError naming every bad key
    print(f"{args.config}: ok", file=sys.stderr)
    return 0 if args.check else serve_deploy(args.config, args.address)


def cmd_serve(args) -> int:
    if not args.standalone:
        return cmd_serve_cluster(args)
    import asyncio
    from pathlib import Path

    from dspine.replica import Engine

    from .embedded import resolve_model_dirs
    from .server import ServerConfig, serve_forever

    target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed=False)
    config = ServerConfig(host=args.host, port=50051 if args.port is None else args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          auth_token=args.auth_token, model_name=Path(target_dir).name)
    engine = Engine.from_pretrained(target_dir, draft_dir, _engine_config(
        args, max_concurrency=args.max_concurrency or 8, max_seq_len=args.max_seq_len))
    asyncio.run(serve_forever(engine, config))
    return 0


def cmd_info(args) -> int:
    from dspine.replica.models.dspine_config import info_text

    print(info_text(args.draft_preset))
    return 0


def cmd_plan(args) -> int:
    import dataclasses
    from pathlib import Path

    from dspine.replica.memory_plan import PlanConfig, parse_size, plan_memory
    from dspine.replica.models.dspine_config import DraftArgs
    from dspine.replica.models.target_config import TargetArgs

    if args.target:
        target = TargetArgs.from_hf_config(json.loads((Path(args.target) / "config.json").read_text()))
    else:
        target = TargetArgs.from_name(args.target_preset)
    drafter = None
    if args.draft:
        drafter = DraftArgs.from_config(json.loads((Path(args.draft) / "config.json").read_text()))
    elif not args.no_draft:
        drafter = DraftArgs.from_name(args.draft_preset)
    config = PlanConfig(device_memory_bytes=parse_size(args.device_memory), max_concurrency=args.max_concurrency,
                        max_seq_len=args.max_seq_len, draft_pool=args.draft_pool,
                        draft_pool_tokens=args.draft_pool_tokens, dtype_bytes=args.dtype_bytes,
                        draft_dtype_bytes=args.dtype_bytes, retrieval=args.retrieval,
                        verify_rows=drafter.block_size if drafter is not None else 1,
                        verify_keeps=args.verify_keeps, prefill_chunk_tokens=args.prefill_chunk_tokens,
                        reserved_bytes=parse_size(args.reserved))
    plan = plan_memory(target, drafter, config)
    if args.json:
        print(json.dumps({"fits": plan.fits, "total_bytes": plan.total_bytes, "left_bytes": plan.left_bytes,
                          "device_memory_bytes": plan.device_memory_bytes,
                          "lines": [dataclasses.asdict(line) for line in plan.lines]}, indent=2))
    else:
        print(plan.format())
    return 0 if plan.fits else 1


def cmd_bench(args) -> int:
    if args.bench == "cluster":
        from dspine.benchmarks.cluster import bench_cluster, format_report

        result = bench_cluster(num_prompts=args.num_prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                               temperature=args.temperature, seed=args.seed, rounds=args.rounds,
                               concurrency=args.concurrency, num_requests=args.requests, threads=args.threads)
        print(json.dumps(result, indent=2) if args.json else format_report(result))
        return 0
    from dspine.benchmarks.engine import bench_engine
    from dspine.benchmarks.prompts import heldout_prompts
    from dspine.benchmarks.sweep import bench_sweep, format_sweep
    from dspine.benchmarks.transformers_baseline import bench_target

    from .embedded import resolve_model_dirs

    if args.bench == "prefill":
        from dspine.benchmarks.prefill import bench_prefill, format_report

        target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed=not args.no_spec)
        result = bench_prefill(target_dir, None if args.no_spec else draft_dir, prompt_len=args.prompt_len,
                               chunk=args.chunk, speculative=not args.no_spec)
        print(json.dumps(result, indent=2) if args.json else format_report(result))
        return 0

    if args.bench == "target":
        target_dir, _ = resolve_model_dirs(args.target, None, speculative_needed=False)
        report = bench_target(target_dir, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                              repeats=args.repeats, device=args.device)
        print(report.format())
        return 0
    target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed=True)
    from dspine.replica import Engine, SamplingParams

    if args.kv_layouts is not None:
        from dspine.benchmarks.kv_layouts import bench_kv_layouts, format_kv_layouts

        report = bench_kv_layouts(target_dir, draft_dir, num_requests=args.num_prompts, prompt_len=args.kv_layouts,
                                  new_tokens=args.max_new_tokens, repeats=args.repeats, device=args.device,
                                  dtype=args.dtype, adaptive=not args.no_adaptive)
        print(json.dumps(report, indent=2) if args.json else format_kv_layouts(report))
        return 0
    # One engine for every phase: a second engine's thread would slow both (replica/device_thread.py).
    if args.sweep:
        engine = Engine.from_pretrained(target_dir, draft_dir, _engine_config(args, max_concurrency=8))
        seed = 0 if args.seed is None else args.seed
        rows = bench_sweep(engine, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                           repeats=args.repeats, seed=seed)
        served = None
        if args.through_server:
            from dspine.benchmarks.sweep_server import bench_sweep_server

            served = bench_sweep_server(heldout_prompts(engine, args.num_prompts, args.prompt_len),
                                        repeats=args.repeats, seed=seed, target_dir=target_dir, draft_dir=draft_dir)
        if args.json:
            print(json.dumps(rows if served is None else {"inline": rows, "server": served}, indent=2))
        else:
            print(format_sweep(rows))
            if served is not None:
                print("\nthrough the standalone gRPC server (SDK streaming, same prompts):")
                print(format_sweep(served))
        return 0
    if args.plot:  # before minutes of benchmarking, not after
        from dspine.benchmarks.plot import PlotUnavailableError, require_pyplot

        try:
            require_pyplot()
        except PlotUnavailableError as e:
            print(f"dspine bench: error: {e}", file=sys.stderr)
            return 2
    engine = Engine.from_pretrained(target_dir, draft_dir, _engine_config(args, max_concurrency=max(args.concurrency, 1)))
    report = bench_engine(target_dir, draft_dir, _sampling_from_args(args), num_prompts=args.num_prompts,
                          prompt_len=args.prompt_len, concurrency=args.concurrency, repeats=args.repeats,
                          engine=engine, trace_out=args.trace_out)
    overhead = None
    if args.tracing:
        from dspine.benchmarks.tracing_overhead import bench_tracing_overhead

        sampling = _sampling_from_args(args)
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


def _is_request_error(exc: BaseException) -> bool:
    """An engine's InvalidRequestError (checked without importing the engine, which loads torch)."""
    if "dspine.replica.errors" not in sys.modules:
        return False
    from dspine.replica.errors import InvalidRequestError

    return isinstance(exc, InvalidRequestError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "serve": cmd_serve, "status": cmd_status, "deploy": cmd_deploy,
                "info": cmd_info, "plan": cmd_plan, "bench": cmd_bench, "train": cmd_train}
    try:
        return handlers[args.command](args)
    except Exception as e:  # a request's or a server's error is one line with exit 1, not a traceback
        from .client_errors import DSpineClientError, Unavailable

        if isinstance(e, DSpineClientError):
            hint = f" (is a dspine server listening at {args.server}?)" if isinstance(e, Unavailable) and getattr(
                args, "server", None) else ""
            print(f"dspine {args.command}: error: {e}{hint}", file=sys.stderr)
            return 1
        if _is_request_error(e):  # an engine's field error, named as a server names it
            from .errors import status_for

            code, message = status_for(e)
            print(f"dspine {args.command}: error: {code.name}: {message}", file=sys.stderr)
            return 1
        if isinstance(e, (ValueError, FileNotFoundError)):  # bad arguments or files
            print(f"dspine {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
