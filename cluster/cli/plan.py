"""``dspine info`` (a drafter preset's memory report) and ``dspine plan`` (the memory plan of a
target + drafter on one device; exit 1 when it does not fit)."""

from __future__ import annotations

import json


def add_parser(commands) -> None:
    info = commands.add_parser("info", help="print a drafter preset's memory report")
    info.add_argument("--draft-preset", default="dspine-27b-b16")

    plan = commands.add_parser("plan", help="the memory plan of a target + drafter on one device (exit 1: does "
                                            "not fit)")
    plan.add_argument("--target-preset", default="Qwen3.8-27B", help="target preset (default: the 27B reference)")
    plan.add_argument("--target", help="HF-format target directory (its config.json; overrides --target-preset)")
    plan.add_argument("--draft-preset", default="dspine-27b-b16", help="drafter preset")
    plan.add_argument("--draft", help="DSpine draft directory (its config.json; overrides --draft-preset)")
    plan.add_argument("--no-draft", action="store_true", help="target only")
    plan.add_argument("--sampled-draft", metavar="DIR", help="a second drafter for sampled requests (its config.json "
                                                             "must equal the drafter's): its weights are planned too")
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
    info.set_defaults(handler=cmd_info)
    plan.set_defaults(handler=cmd_plan)


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
    if args.sampled_draft:
        from dspine.replica.drafters import check_same_geometry

        if drafter is None:
            raise ValueError("--sampled-draft: needs a drafter (drop --no-draft)")
        check_same_geometry(drafter, DraftArgs.from_config(
            json.loads((Path(args.sampled_draft) / "config.json").read_text())))
    config = PlanConfig(device_memory_bytes=parse_size(args.device_memory), max_concurrency=args.max_concurrency,
                        max_seq_len=args.max_seq_len, draft_pool=args.draft_pool,
                        draft_pool_tokens=args.draft_pool_tokens, dtype_bytes=args.dtype_bytes,
                        draft_dtype_bytes=args.dtype_bytes, retrieval=args.retrieval,
                        verify_rows=drafter.block_size if drafter is not None else 1,
                        verify_keeps=args.verify_keeps, prefill_chunk_tokens=args.prefill_chunk_tokens,
                        reserved_bytes=parse_size(args.reserved), num_drafters=2 if args.sampled_draft else 1)
    plan = plan_memory(target, drafter, config)
    if args.json:
        print(json.dumps({"fits": plan.fits, "total_bytes": plan.total_bytes, "left_bytes": plan.left_bytes,
                          "device_memory_bytes": plan.device_memory_bytes,
                          "lines": [dataclasses.asdict(line) for line in plan.lines]}, indent=2))
    else:
        print(plan.format())
    return 0 if plan.fits else 1

