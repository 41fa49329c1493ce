"""``dspine generate``: one prompt through a local engine or, with ``--server``, a dspine gRPC server.

Both ways print the same thing (text, token ids, finish reason, the speculation and throughput
figures, logprobs when asked), built by one function from what each way returns.
"""

from __future__ import annotations

import json
import sys

from .options import add_model_args, add_sampling_args, engine_from_args, option_args, sampling_from_args


def add_parser(commands) -> None:
    generate = commands.add_parser("generate", help="generate text with the engine (or a server)")
    add_model_args(generate)
    add_sampling_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--no-spec", action="store_true", help="target-only decoding")
    generate.add_argument("--json", action="store_true", help="print a JSON object")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--server", help="HOST:PORT of a dspine gRPC server instead of a local engine")
    generate.add_argument("--trace", action="store_true",
                          help="with --server: trace the call (OTLP export from OTEL_EXPORTER_OTLP_ENDPOINT) and "
                               "print its trace id")
    generate.set_defaults(handler=cmd_generate)


def cmd_generate(args) -> int:
    result = _generate_on_server(args) if args.server else _generate_locally(args)
    _print_result(args, result)
    return 0


def _result_dict(text: str, token_ids, finish_reason: str, speculative: bool, cycles: int,
                 mean_accepted_len: float, decode_tokens_per_s: float, logprobs, with_logprobs: bool,
                 drafter: str = "") -> dict:
    """What ``dspine generate`` prints (``--json``: as is), from either way of generating;
    ``logprobs`` entries have ``token_id``, ``logprob`` and ``top`` ((token_id, logprob) pairs);
    ``drafter``: "greedy" / "sampled" ("" when not speculative)."""
    result = {"text": text, "token_ids": token_ids, "finish_reason": finish_reason, "speculative": speculative,
              "drafter": drafter, "cycles": cycles, "mean_accepted_len": round(mean_accepted_len, 3),
              "decode_tokens_per_s": round(decode_tokens_per_s, 1)}
    if with_logprobs:
        result["logprobs"] = [{"token_id": e.token_id, "logprob": round(e.logprob, 6),
                               "top": [[i, round(v, 6)] for i, v in e.top]} for e in logprobs or []]
    return result


def _generate_locally(args) -> dict:
    engine = engine_from_args(args, speculative_needed=not args.no_spec)
    params = sampling_from_args(args, args.stop)
    if not args.prompt:  # the server's rule and words (cluster/validation.py validate_text)
        from dspine.replica.errors import InvalidRequestError

        raise InvalidRequestError("text", "must not be empty")
    result = engine.generate_text(args.prompt, params, speculative=False if args.no_spec else None)
    stats = result.stats
    return _result_dict(result.text, result.token_ids, result.finish_reason, stats.speculative,
                        stats.spec.num_cycles if stats.spec else 0, stats.spec.mean_accepted_len if stats.spec else 0.0,
                        stats.decode_tokens_per_second, result.logprobs, args.logprobs is not None, stats.drafter)


def _generate_on_server(args) -> dict:
    import contextlib

    from ..client import DSpineClient

    span = contextlib.nullcontext()
    if args.trace:
        from opentelemetry import trace

        from .. import tracing

        tracing.configure("dspine-cli", processors=None if tracing.exporting_env() else [])
        span = trace.get_tracer("dspine.cli").start_as_current_span("dspine generate")
    with span as root, DSpineClient(args.server) as client:
        result = client.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                                 speculative=not args.no_spec, **option_args(args))
        if args.trace:
            print(f"trace id: {root.get_span_context().trace_id:032x}", file=sys.stderr)
    if args.trace:
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush()  # the spans leave before the process exits
    spec = result.speculation  # the figures a local run prints, from the server's final message
    return _result_dict(result.text, result.token_ids, result.finish_reason, spec.speculative, spec.cycles,
                        spec.mean_accepted_len, result.decode_tokens_per_second, result.logprobs,
                        args.logprobs is not None, spec.drafter)


def _print_result(args, result: dict) -> None:
    if args.json:
        print(json.dumps(result))
        return
    print(args.prompt + (result["text"] or ""))
    figures = {k: v for k, v in result.items() if k not in ("text", "token_ids", "finish_reason", "logprobs")}
    print(f"\n[{result['finish_reason']}; " + ", ".join(f"{k}={v}" for k, v in figures.items()) + "]",
          file=sys.stderr)
    for entry in result.get("logprobs", []):
        top = " ".join(f"{i}:{v:.4f}" for i, v in entry["top"])
        print(f"token {entry['token_id']} logprob {entry['logprob']:.4f}" + (f"  top {top}" if top else ""),
              file=sys.stderr)
