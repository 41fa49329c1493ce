"""What several commands share: the model and sampling flags, and the engine and sampling
configs built from them. Heavy imports stay inside the functions (``dspine --help`` is instant)."""

from __future__ import annotations

import argparse


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--target/--draft and the engine knobs of a command that loads the model."""
    parser.add_argument("--target", help="HF-format target directory (default: the embedded tiny target)")
    parser.add_argument("--draft", help="DSpine draft directory (default: the embedded drafter when --target is not given)")
    parser.add_argument("--sampled-draft", metavar="DIR",
                        help="a second DSpine draft directory (same config.json as --draft) for sampled requests "
                             "(default: the embedded draft-sampled/ when shipped and neither --target nor --draft "
                             "is given)")
    parser.add_argument("--sampled-draft-min-temperature", type=float, default=None, metavar="T",
                        help="requests with temperature >= T draft with the sampled drafter (default: the "
                             "engine's, 0.3)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto")
    parser.add_argument("--draft-dtype", default="auto",
                        help="the drafter's dtype: float32, bfloat16 or auto (auto: the target's); it changes "
                             "what is proposed, never what is emitted")
    parser.add_argument("--verify-threshold", type=float, default=None,
                        help="dynamic verification: verify a draft row while the drafter's confidence product "
                             "is >= this (0: the whole block; default: the engine's)")
    parser.add_argument("--retrieval", default="auto", choices=["auto", "exact", "fp8", "bf16"],
                        help="the tail's candidate retrieval (auto: fp8 on cuda, bf16 on CPUs with native bf16)")
    parser.add_argument("--no-adaptive", action="store_true",
                        help="draft every step for every speculative request (adaptive speculation off)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The sampling flags (vLLM's names and defaults)."""
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


def option_args(args) -> dict:
    """The request options shared by the local engine and the SDK (vLLM's names)."""
    return dict(min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, logit_bias=_logit_bias_from_args(args),
                logprobs=args.logprobs, reproducible=args.reproducible)


def engine_from_args(args, speculative_needed: bool = True):
    """The engine of --target/--draft (or the embedded pair) with the flags' config."""
    from dspine.replica import Engine

    from dspine.replica.gc_freeze import freeze_after_load

    target_dir, draft_dir, sampled_draft_dir = model_dirs_from_args(args, speculative_needed)
    engine = Engine.from_pretrained(target_dir, draft_dir, engine_config(args), sampled_draft_dir=sampled_draft_dir)
    freeze_after_load()
    return engine


def model_dirs_from_args(args, speculative_needed: bool) -> tuple[str, str | None, str | None]:
    """``(target_dir, draft_dir, sampled_draft_dir)`` of --target/--draft/--sampled-draft (or the embedded ones)."""
    from ..embedded import resolve_model_dirs, resolve_sampled_draft_dir

    target_dir, draft_dir = resolve_model_dirs(args.target, args.draft, speculative_needed)
    sampled = resolve_sampled_draft_dir(args.target, args.draft, getattr(args, "sampled_draft", None))
    return target_dir, draft_dir, sampled


def engine_config(args, **extra):
    """The :class:`EngineConfig` of the model flags, with ``extra`` fields on top."""
    from dspine.replica import EngineConfig

    knobs = dict(device=args.device, dtype=args.dtype, draft_dtype=getattr(args, "draft_dtype", "auto"),
                 retrieval=args.retrieval, **extra)
    if getattr(args, "no_adaptive", False):
        knobs["adaptive_speculation"] = False
    if args.verify_threshold is not None:
        knobs["verify_threshold"] = args.verify_threshold
    if getattr(args, "sampled_draft_min_temperature", None) is not None:
        knobs["sampled_draft_min_temperature"] = args.sampled_draft_min_temperature
    return EngineConfig(**knobs)


def sampling_from_args(args, stop=()):
    """The :class:`SamplingParams` of the sampling flags (a bad value exits naming the field)."""
    from dspine.replica import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              max_new_tokens=args.max_new_tokens, stop=tuple(stop), **option_args(args))
    except ValueError as e:  # names the field: "min_p: must be in [0, 1] ..."
        raise SystemExit(f"dspine: error: {e}") from None
