"""The ``dspine`` command line.

    dspine generate --prompt TEXT [--target DIR --draft DIR] [--no-spec] [--json] [--server HOST:PORT]
    dspine serve --standalone [--target DIR --draft DIR] [--host H --port P] [--max-concurrency N]
    dspine info --draft-preset dspine-27b-b16
    dspine bench target | engine
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


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


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

    serve = commands.add_parser("serve", help="serve the gRPC API (--standalone: one engine, no Ray)")
    _add_model_args(serve)
    serve.add_argument("--standalone", action="store_true", help="one engine in this process, no Ray")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--max-concurrency", type=int, default=8)
    serve.add_argument("--max-seq-len", type=int, default=None, help="context (prompt + output) per request")
    serve.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key: TLS)")
    serve.add_argument("--tls-key", help="PEM private key")
    serve.add_argument("--auth-token", help="require 'authorization: Bearer TOKEN' on every call")

    info = commands.add_parser("info", help="print a drafter preset's memory report")
    info.add_argument("--draft-preset", default="dspine-27b-b16")

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
        from dspine.replica.train.target import TargetTrainConfig, train_target

        train_target(TargetTrainConfig(out_dir=args.out, steps=args.steps, batch_size=args.batch_size,
                                       seq_len=args.seq_len, seed=args.seed, max_files=args.max_files))
        return 0
    from dspine.replica.train.draft import DraftTrainConfig, train_draft

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
    if args.verify_threshold is not None:
        knobs["verify_threshold"] = args.verify_threshold
    return EngineConfig(**knobs)


def _sampling_from_args(args, stop=()):
    from dspine.replica import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, stop=tuple(stop))


def cmd_generate(args) -> int:
    if args.server:
        from .client import DSpineClient

        with DSpineClient(args.server) as client:
            result = client.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                                     speculative=not args.no_spec)
        text, token_ids, finish_reason, extra = result.text, result.token_ids, result.finish_reason, {}
    else:
        engine = _engine_from_args(args, speculative_needed=not args.no_spec)
        params = _sampling_from_args(args, args.stop)
        result = engine.generate_text(args.prompt, params, speculative=False if args.no_spec else None)
        text, token_ids, finish_reason = result.text, result.token_ids, result.finish_reason
        stats = result.stats
        extra = {
            "speculative": stats.speculative,
            "cycles": stats.spec.num_cycles if stats.spec else 0,
            "mean_accepted_len": round(stats.spec.mean_accepted_len, 3) if stats.spec else 0.0,
            "decode_tokens_per_s": round(stats.decode_tokens_per_second, 1),
        }
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "finish_reason": finish_reason, **extra}))
    else:
        print(args.prompt + (text or ""))
        if extra:
            print(f"\n[{finish_reason}; " + ", ".join(f"{k}={v}" for k, v in extra.items()) + "]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    if not args.standalone:
        print("dspine serve: only --standalone (one engine, no Ray) is available here", file=sys.stderr)
        return 2
    import asyncio
    from pathlib import Path

    from dspine.replica import Engine

    from .embedded import resolve_model_dirs
    from .server import ServerConfig, serve_forever

    target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed=False)
    config = ServerConfig(host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          auth_token=args.auth_token, model_name=Path(target_dir).name)
    engine = Engine.from_pretrained(target_dir, draft_dir, _engine_config(
        args, max_concurrency=args.max_concurrency, max_seq_len=args.max_seq_len))
    asyncio.run(serve_forever(engine, config))
    return 0


def cmd_info(args) -> int:
    from dspine.replica.models.dspine_config import info_text

    print(info_text(args.draft_preset))
    return 0


def cmd_bench(args) -> int:
    from dspine.replica import bench

    from .embedded import resolve_model_dirs

    if args.bench == "target":
        target_dir, _ = resolve_model_dirs(args.target, None, speculative_needed=False)
        report = bench.bench_target(target_dir, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                    repeats=args.repeats, device=args.device)
        print(report.format())
        return 0
    target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed=True)
    report = bench.bench_engine(target_dir, draft_dir, _sampling_from_args(args), num_prompts=args.num_prompts,
                                prompt_len=args.prompt_len, concurrency=args.concurrency, repeats=args.repeats,
                                config=_engine_config(args, max_concurrency=max(args.concurrency, 1)))
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.format())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "serve": cmd_serve, "info": cmd_info, "bench": cmd_bench, "train": cmd_train}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dspine {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
