"""Distil a DSpine drafter from a frozen target (CPU-friendly, seeded).

The labels are the target's OWN greedy continuations, not corpus text.
Greedy speculative decoding accepts a proposed token exactly when it equals
the target's argmax given everything before it, so the drafter should learn to
predict what the target says at temperature 0, mistakes and repetitions
included. The data recipe:

1. Prompts: windows cut at seeded random offsets from the TRAIN split of the
   stdlib corpus (``corpus.read_texts("train")``; the held-out files that the
   benchmarks prompt with are never used). The prompt length varies per
   generation batch (``prompt_lens``); every sequence has ``seq_len`` tokens.
2. Continuations: the frozen target decodes each batch greedily with the
   batched stateful API (``forward_step`` + ``commit``, argmax with ties to the
   lower id), so every token after the prompt is exactly the target's
   temperature-0 choice. The token sequences are cached on disk
   (``<out_dir>/distill_cache`` by default, keyed by the target weights'
   hash and the data settings), so reruns skip generation, and a run with
   more sequences generates only those a smaller cached run lacks.
3. One stateless target forward over every sequence, computed once and kept
   in memory: the context features (the drafter's taps, bf16) and the
   target's greedy next token after every prefix, ``greedy[t]``.

Labels (``block_labels``): row k of the block anchored at ``a`` is labelled
``greedy[a+k-1]``, the target's temperature-0 token after ``x[..a+k-1]``, for
as long as the sequence itself follows the target's greedy path
(``x[a+j] == greedy[a+j-1]`` for j < k): in a generated continuation that is
every row, so the labels are simply ``x[a+1 .. a+BS-1]``; in prompt text the
rows up to and including the first place where the text departs from the
target's choice (later rows are masked). Text anchors thus add exact row-1 /
row-2 examples in realistic, not-yet-repetitive contexts.

Training step: for each sequence pick ``anchors_per_seq`` anchors, by
default uniform over the target's continuation (every label is target
output). Two opt-in placements (``early_frac``, ``text_anchors``) concentrate
anchors right after the prompt or also put them in prompt text; on the
embedded pair they measured a lower mean accepted length on ``dspine bench
engine`` (2.97 vs 3.20), so the shipped drafter uses neither. The block is
row 0 = the anchor token, rows 1..BS-1 = placeholder; its context is the
fused features of positions < a inside the window.
``DSpineDrafter.forward_train`` runs all blocks without the KV pool (same
maths as ``append_context`` + ``draft``).

Loss = main + ``tail_weight`` * tail, both position-weighted by
``exp(-(k-1)/decay_gamma)`` for row k (normalised; acceptance stops at the
first miss, so late rows matter less):

- main: cross-entropy of the drafter's logits (final norm + the target's LM
  head) for rows 1..BS-1; this is what the tail's candidate retrieval reads.
- tail: the LAST bridge write recomputed with the TRUE predecessor's code
  ``sqrt(D) * codebook[x[a+k-1]]`` (row 1: the anchor) in place of the
  predicted code, then final norm + head, cross-entropy against the label.
  This is exactly the score the serving tail maximises when its chain is
  still on the target's path, and it trains the codebook and the gates.

The target's embedding and LM head are frozen and shared (never copied into
the checkpoint). AdamW, linear warmup + cosine, gradient clipping. The result
is saved with ``save_drafter`` (what ``load_drafter`` and the engine read),
plus ``train_summary.json``. The summary's held-out figure
(``simulate_greedy_cycles``) replays greedy speculative decoding offline on
held-out prompts exactly as ``dspine bench engine`` runs it (64-token
prompts, 128 new tokens) and reports the mean accepted length per cycle;
on the first embedded drafter it reproduced the engine's 3.20 over 254
cycles exactly.

The sampled drafter (``--recipe sampled``, ``SAMPLED_RECIPE``; shipped as
``embedded/draft-sampled``, chosen by the engine for requests at temperature
>= 0.3) changes three things. The continuations are SAMPLED at 0.7 (one seeded
generator per generation batch, so a cache still extends exactly): a greedy
continuation is a context no sampled request ever shows the drafter. The
label of row k is the target's own top-16 distribution after the true prefix,
compared at the request's temperature (softmax(target / 0.7) against
log_softmax(drafter / 0.7)), on every row: a sampled request accepts row k
with probability sum_x min(p(x), q(x)), which a one-hot label does not teach,
and the greedy label's path mask would hide every row after the first
departure. It starts from the greedy drafter's weights (``init_from``). Its
log adds the expected sampled accepted length (``accept_sampled``, with true
predecessors), and its summary the same on held-out text the target sampled
(``heldout_sampled``, against the target's full distribution).

One job per module: ``config`` (settings), ``continuations`` (the target's
decoding), ``data`` (prompts, generation, the cache), ``target_pass``
(features and greedy labels), ``labels``, ``anchors``, ``losses``,
``schedule`` (optimiser and learning rate), ``evaluate`` (the held-out
figures) and ``loop`` (``train_draft``, the recipe end to end).
"""

from __future__ import annotations

from .config import RECIPES, SAMPLED_RECIPE, TINY_DRAFTER, DraftTrainConfig
from .continuations import sample_continuations
from .loop import train_draft

__all__ = ["RECIPES", "SAMPLED_RECIPE", "TINY_DRAFTER", "DraftTrainConfig", "sample_continuations", "train_draft"]
