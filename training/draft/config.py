"""The drafter recipe's settings: the embedded drafter's geometry and every training knob."""

from __future__ import annotations

from dataclasses import dataclass

# The embedded drafter's geometry (for the 256-wide, 6-layer, 4096-vocab target).
# hidden = the target's (the LM head is shared); 2 layers (the 27B pair drafts with
# 5 layers against 64, the drafter must stay much cheaper than the target); attention
# 4 x 64 query / 2 KV heads and FFN 768 like the target's own layers; code width 128
# and message width 64 (M = D / 2 as in the 27B's 1024 / 512); K = 16 candidates from
# R = 128 retrieved as in the release; window 512 covers every training sequence and
# the benchmark contexts (64-token prompt + 128 new tokens) with room to spare.
TINY_DRAFTER = dict(
    feature_layers=(1, 2, 3, 4, 5),  # every layer after the first, as the 27B taps 1..61 of 64
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768, window=512,
    rope_base=10_000.0, code_dim=128, message_dim=64, head_topk=16, num_retrieve=128, block_size=16,
)


@dataclass(frozen=True)
class DraftTrainConfig:
    """Every setting of ``train_draft``; the defaults are the shipped drafter's recipe (the CLI holds no copy)."""

    target_dir: str
    out_dir: str
    steps: int = 3000
    seed: int = 0
    max_files: int | None = None  # limit the corpus (pipeline tests)
    # distillation data
    # Greedy continuations generated from train-split prompts. More data was the largest lever on
    # `dspine bench engine` (mean accepted 3.16 / 3.26 / 3.88 for 4k / 8k / 16k sequences); 16k
    # takes about 23 min to generate on 2 cores and 11 GB for the bf16 features.
    num_sequences: int = 16384
    seq_len: int = 256  # prompt + continuation
    prompt_lens: tuple[int, ...] = (32, 64, 96, 128)  # cycled over generation batches
    gen_batch: int = 64  # prompts decoded together with forward_step / commit
    cache_dir: str | None = None  # default: <out_dir>/distill_cache
    eval_sequences: int = 32  # held-out continuations for the final acceptance estimate (0: skip)
    eval_prompt_len: int = 64  # as `dspine bench engine`'s prompts
    eval_new_tokens: int = 128  # as `dspine bench engine`'s default max_new_tokens
    # drafter
    model_overrides: tuple = ()  # (key, value) pairs over TINY_DRAFTER
    # optimisation
    batch_size: int = 16  # sequences per step
    anchors_per_seq: int = 8  # blocks per sequence per step
    # Anchor placement. The shipped drafter uses the defaults: anchors uniform over the target's
    # continuation. Early anchors and text anchors (see sample_anchors) measured lower on
    # `dspine bench engine` (mean accepted 2.97 vs 3.20), so they are opt-in.
    early_frac: float = 0.0  # share of anchors in the first early_span continuation positions
    early_span: int = 32
    text_anchors: bool = False  # also anchor inside the prompt text (labels while it follows the target)
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    decay_gamma: float = 7.0  # row k weight exp(-(k-1)/gamma)
    tail_weight: float = 1.0
    # Soft labels (opt-in): also match the target's own distribution after x[..a+k-1], kept as its
    # top soft_label_topk tokens (renormalised); the row loss becomes
    # (1 - soft_label_weight) * CE(greedy label) + soft_label_weight * CE(target top-k distribution).
    soft_label_topk: int = 0
    soft_label_weight: float = 0.5
    # The temperature T of the soft-label loss: both distributions are compared as the engine samples
    # them at T (softmax(target / T) over the top k vs log_softmax(drafter / T)), so a drafter trained for
    # temperature-T requests spends its capacity where their acceptance, 1 - TV(p_T, q_T), is decided.
    soft_label_temperature: float = 1.0
    # Continuations sampled at this temperature instead of greedy (0): the contexts that sampled requests
    # put in front of the drafter (a greedy continuation is a context no sampled request ever shows it).
    continuation_temperature: float = 0.0
    # Start from a trained drafter's weights (same geometry) instead of a random init.
    init_from: str | None = None
    threads: int = 0  # 0 -> torch's default
    # Recompute the target's features and labels for each step's batch instead of keeping them for
    # every sequence: memory no longer grows with num_sequences (16,384 x 256 positions x 5 taps x
    # 256 dims held 11 GB in bf16) for one extra target forward per step. The same tensors either way.
    stream_features: bool = False
    log_every: int = 50


# The sampled drafter's recipe (embedded/draft-sampled), over the defaults above: continuations sampled at
# 0.7, labels the target's own top-16 distribution at 0.7 only (no greedy label: a sampled request accepts a
# row with probability sum min(p, q), which a one-hot label does not teach), fine-tuned from the greedy drafter.
# Its tail proposes over 32 candidates per row, not 16: at 0.7 the 16 hold only about half of the target's
# mass from row 2 on (the training loss does not depend on it; the logged acceptance does).
SAMPLED_RECIPE = dict(continuation_temperature=0.7, soft_label_topk=16, soft_label_weight=1.0,
                      soft_label_temperature=0.7, lr=1e-3, gen_batch=256, model_overrides=(("head_topk", 32),))
RECIPES = {"greedy": {}, "sampled": SAMPLED_RECIPE}

