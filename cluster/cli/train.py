"""``dspine train target|draft``: train the embedded pair from scratch (CPU-friendly, seeded)."""

from __future__ import annotations


def add_parser(commands) -> None:
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
    train_draft.add_argument("--stream-features", action="store_true",
                             help="recompute the target's features per training step instead of keeping them for "
                                  "every sequence (memory independent of --num-sequences)")
    train_draft.add_argument("--recipe", choices=("greedy", "sampled"), default="greedy",
                             help="greedy: the shipped embedded/draft; sampled: embedded/draft-sampled (continuations "
                                  "sampled at 0.7, the target's top-16 distribution at 0.7 as labels)")
    train_draft.add_argument("--init-from", default=None,
                             help="start from this trained drafter's weights (same geometry)")
    train_target.set_defaults(handler=cmd_train_target)
    train_draft.set_defaults(handler=cmd_train_draft)


def cmd_train_target(args) -> int:
    from dspine.training.target import TargetTrainConfig, train_target

    train_target(TargetTrainConfig(out_dir=args.out, steps=args.steps, batch_size=args.batch_size,
                                   seq_len=args.seq_len, seed=args.seed, max_files=args.max_files))
    return 0


def cmd_train_draft(args) -> int:
    from dspine.training.draft import RECIPES, DraftTrainConfig, train_draft

    given = {"steps": args.steps, "seed": args.seed, "max_files": args.max_files,
             "num_sequences": args.num_sequences, "threads": args.threads,
             "stream_features": args.stream_features or None, "init_from": args.init_from}
    train_draft(DraftTrainConfig(target_dir=args.target, out_dir=args.out,
                                 **{**RECIPES[args.recipe], **{k: v for k, v in given.items() if v is not None}}))
    return 0
