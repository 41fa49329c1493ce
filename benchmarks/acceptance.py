"""Acceptance of seed-reproducible (Gumbel) sampling against ordinary rejection sampling, one run.

``python -m dspine.benchmarks.acceptance [--temperature 0.7] [--seeds 8] [--prompts 8]`` runs the
same held-out prompts and seeds on the embedded pair (or ``--target/--draft``) twice, speculative,
whole-block verification, adaptive speculation off (so both modes draft every step): once with
ordinary sampling (rejection test ``u * q < p``), once with ``reproducible=True`` (exact match against
the target's Gumbel-argmax, the drafter proposing with the same noise). It prints accepted draft
tokens per cycle of each and their ratio. Acceptance is a property of the proposals, not of timing,
so the figures are machine-independent up to rounding.
"""

from __future__ import annotations

import argparse
import json

from dspine.replica import Engine, EngineConfig, SamplingParams


def measure(engine: Engine, prompts: list[list[int]], seeds: int, temperature: float, top_p: float,
            max_new_tokens: int) -> dict:
    """Mean accepted draft tokens per cycle for ordinary and Gumbel sampling on the same requests."""
    out = {}
    for mode, reproducible in (("rejection", False), ("gumbel", True)):
        params = [SamplingParams(temperature=temperature, top_p=top_p, seed=seed, reproducible=reproducible,
                                 max_new_tokens=max_new_tokens, ignore_eos=True)
                  for _ in prompts for seed in range(seeds)]
        requests = [p for p in prompts for _ in range(seeds)]
        results = engine.generate_many(requests, params, speculative=True)
        cycles = sum(r.stats.spec.num_cycles for r in results)
        accepted = sum(r.stats.spec.num_accepted_tokens for r in results)
        out[mode] = {"cycles": cycles, "accepted_per_cycle": round(accepted / cycles, 4),
                     "committed_per_cycle": round(accepted / cycles + 1, 4)}
    out["ratio_gumbel_over_rejection"] = round(out["gumbel"]["accepted_per_cycle"]
                                               / out["rejection"]["accepted_per_cycle"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line of ``python -m dspine.benchmarks.acceptance``: prints the report as JSON."""
    from dspine import embedded

    from .prompts import heldout_prompts

    parser = argparse.ArgumentParser(prog="python -m dspine.benchmarks.acceptance", description=__doc__)
    parser.add_argument("--target", default=str(embedded.TARGET_DIR))
    parser.add_argument("--draft", default=str(embedded.DRAFT_DIR))
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(args.target, args.draft, EngineConfig(
        device=args.device, dtype="float32", adaptive_speculation=False, verify_threshold=0.0))
    prompts = heldout_prompts(engine, args.prompts, args.prompt_len)
    report = measure(engine, prompts, args.seeds, args.temperature, args.top_p, args.max_new_tokens)
    print(json.dumps({"temperature": args.temperature, "top_p": args.top_p, "requests": len(prompts) * args.seeds,
                      "max_new_tokens": args.max_new_tokens, **report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
