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
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspine.progress import Progress
from ..models.dspine import DSpineDrafter
from ..models.dspine_checkpoint import save_drafter
from ..models.dspine_config import DraftArgs
from ..models.loader import load_target
from ..tokenizer import Tokenizer
from . import corpus

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
    threads: int = 0  # 0 -> torch's default
    log_every: int = 50


# ----------------------------------------------------------------------------- data
def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _target_fingerprint(target_dir: Path) -> str:
    parts = sorted(target_dir.glob("*.safetensors")) + [target_dir / "config.json", target_dir / "tokenizer.json"]
    return hashlib.sha256("".join(_file_digest(p) for p in parts if p.exists()).encode()).hexdigest()[:16]


def sample_prompts(tokenizer: Tokenizer, split: str, count: int, lengths: list[int], seed: int,
                   max_files: int | None = None) -> list[list[int]]:
    """``count`` prompts, prompt i of length ``lengths[i]``, cut at seeded random offsets from the split's
    files (files visited in a seeded random order, a few windows per file, so the prompts are diverse)."""
    texts = corpus.read_texts(split, max_files=max_files)
    if not texts:
        raise ValueError(f"no {split} corpus files")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(texts), generator=g).tolist()
    prompts: list[list[int]] = []
    while len(prompts) < count:  # small corpora (max_files) are visited again at new offsets
        before = len(prompts)
        for start in range(0, len(order), 64):  # tokenize 64 files at a time (Rust batch encode)
            chunk = [texts[i] for i in order[start : start + 64]]
            for enc in tokenizer.tokenizer.encode_batch(chunk):
                ids = enc.ids
                per_file = max(1, len(ids) // 2048)
                for _ in range(per_file):
                    n = lengths[len(prompts)]
                    if len(ids) <= n:
                        break
                    off = int(torch.randint(0, len(ids) - n, (1,), generator=g))
                    prompts.append(ids[off : off + n])
                    if len(prompts) == count:
                        return prompts
        if len(prompts) == before:
            raise ValueError(f"no {split} corpus file is longer than {max(lengths)} tokens")
    return prompts


@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, total_len: int) -> torch.Tensor:
    """prompts [B, P] -> [B, total_len]: the prompt followed by the target's greedy tokens
    (batched stateful decoding: one prefill, then one forward_step + commit per token)."""
    B, P = prompts.shape
    out = torch.empty(B, total_len, dtype=torch.long)
    out[:, :P] = prompts
    if total_len == P:
        return out
    states = [target.new_state() for _ in range(B)]
    step = target.forward_step(prompts, states)
    target.commit(states, [P] * B)
    for t in range(P, total_len):
        nxt = step.logits[:, -1].argmax(-1)  # ties -> lower id
        out[:, t] = nxt
        if t + 1 < total_len:
            step = target.forward_step(nxt[:, None], states)
            target.commit(states, [1] * B)
    for s in states:
        s.free()
    return out


def _cached_prefix(cache: Path, split: str, settings: str, count: int, gen_batch: int):
    """The largest ``split`` cache in ``cache``'s folder made with the same ``settings`` and fewer sequences.

    Its rows are exactly the first rows of a larger run: prompts are one seeded stream and every
    generation batch is decoded on its own, so a run of ``count`` sequences may start from it."""
    best, best_count = None, 0
    for path in cache.parent.glob(f"{split}-*.safetensors"):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        n = int(meta.get("count", 0))
        if meta.get("settings") == settings and best_count < n < count and n % gen_batch == 0:
            best, best_count = path, n
    return best


def distillation_data(target, tokenizer: Tokenizer, split: str, count: int, cfg: DraftTrainConfig, seed: int,
                      cache: Path | None, log=print, settings: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [count, seq_len] int64, prompt_len [count] int64)``, from the cache when it matches.

    With ``settings`` (every data setting but the count, as a string) a missing cache is started
    from the largest smaller cache with the same settings: only the remaining sequences are
    generated, and the result equals a run from scratch."""
    lens = [cfg.prompt_lens[(i // cfg.gen_batch) % len(cfg.prompt_lens)] for i in range(count)]
    if cache is not None and cache.exists():
        data = load_file(str(cache))
        log(f"distillation data ({split}): {count} cached sequences from {cache}")
        return data["tokens"].long(), data["prompt_len"].long()
    prompts = sample_prompts(tokenizer, split, count, lens, seed, cfg.max_files)
    rows, first = [], 0
    prefix = _cached_prefix(cache, split, settings, count, cfg.gen_batch) if cache is not None and settings else None
    if prefix is not None:
        data = load_file(str(prefix))
        rows, first = [data["tokens"].long()], data["tokens"].shape[0]
        if data["prompt_len"].tolist() != lens[:first]:
            raise ValueError(f"{prefix}: its prompt lengths do not match the settings it was saved with")
        log(f"distillation data ({split}): the first {first} sequences from {prefix}")
    start = time.time()
    progress = Progress(count - first, f"{split} continuations", unit="sequences")
    for b0 in range(first, count, cfg.gen_batch):
        batch = torch.tensor(prompts[b0 : b0 + cfg.gen_batch], dtype=torch.long)
        rows.append(greedy_continue(target, batch, cfg.seq_len))
        done = b0 + batch.shape[0]
        log(f"  generated {done}/{count} {split} continuations ({time.time() - start:.0f} s)")
        progress.update(batch.shape[0])
    progress.close()
    tokens, prompt_len = torch.cat(rows), torch.tensor(lens, dtype=torch.long)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": tokens.int().contiguous(), "prompt_len": prompt_len.int()}, str(cache),
                  metadata={"settings": settings or "", "count": str(count)})
    return tokens, prompt_len


@torch.no_grad()
def target_pass(target, tokens: torch.Tensor, taps: tuple[int, ...], chunk: int = 16,
                dtype: torch.dtype = torch.bfloat16, soft_topk: int = 0):
    """One stateless target forward over every sequence (chunked) ->
    ``(features [N, L, F, H] in dtype, greedy [N, L] int64, soft)``: the taps of every position, the
    target's greedy next token after every prefix (``greedy[:, t] = argmax p(. | x[..t])``) and, with
    ``soft_topk``, its top-k next-token distribution as ``SoftLabels`` (else None)."""
    N, L = tokens.shape
    feats = torch.empty(N, L, len(taps), target.args.hidden_size, dtype=dtype)
    greedy = torch.empty(N, L, dtype=torch.long)
    soft = SoftLabels.empty(N, L, soft_topk) if soft_topk else None
    for i in range(0, N, chunk):
        out = target(tokens[i : i + chunk], feature_layers=taps)
        feats[i : i + chunk] = out.features.to(dtype)
        greedy[i : i + chunk] = out.logits.argmax(-1)
        if soft is not None:
            top = out.logits.float().log_softmax(-1).topk(soft_topk, dim=-1)
            soft.ids[i : i + chunk] = top.indices.to(soft.ids.dtype)
            soft.logp[i : i + chunk] = top.values.to(soft.logp.dtype)
    return feats, greedy, soft


@dataclass
class SoftLabels:
    """The target's top-k next-token distribution after every prefix of every sequence."""

    ids: torch.Tensor  # [N, L, k] int32
    logp: torch.Tensor  # [N, L, k] bf16 log-probabilities (of the full softmax)

    @classmethod
    def empty(cls, n: int, length: int, k: int) -> "SoftLabels":
        return cls(torch.empty(n, length, k, dtype=torch.int32), torch.empty(n, length, k, dtype=torch.bfloat16))

    def __getitem__(self, index) -> "SoftLabels":
        return SoftLabels(self.ids[index], self.logp[index])

    def at_blocks(self, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row k of the block at anchor a reads position a+k-1: ``(ids [B, A, BS-1, k] int64,
        probs [B, A, BS-1, k] fp32 renormalised over the k)``. anchors [B, A]."""
        idx = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)  # [B, A, BS-1]
        k = self.ids.shape[-1]
        flat = idx.flatten(1)[..., None].expand(-1, -1, k)
        ids = self.ids.gather(1, flat).view(*idx.shape, k).long()
        probs = self.logp.gather(1, flat).view(*idx.shape, k).float().softmax(-1)
        return ids, probs


# ----------------------------------------------------------------------------- losses
def row_weights(num_rows: int, gamma: float, device=None) -> torch.Tensor:
    """[num_rows] exp(-(k-1)/gamma) for rows k = 1..num_rows, normalised to sum 1."""
    w = torch.exp(-torch.arange(num_rows, device=device, dtype=torch.float32) / gamma)
    return w / w.sum()


def tail_hidden(drafter: DSpineDrafter, out, pred_ids: torch.Tensor) -> torch.Tensor:
    """The last bridge write of rows 1..BS-1 redone with the codes of given predecessor tokens.
    out: forward_train's DraftOut ([B, A, BS, ...]); pred_ids [B, A, BS-1] -> final-normed hidden
    [B, A, BS-1, H] (what the serving tail scores: head_i . RMSNorm_g(x_t + r_t W m_t(j)))."""
    br = drafter.bridge
    c_pred = math.sqrt(drafter.args.code_dim) * br.codebook[pred_ids]  # [B, A, BS-1, D]
    c_recv = out.codes[:, :, 1:]
    gate = torch.sigmoid(c_recv @ br.gate_recv.t() + c_pred @ br.gate_pred.t() + br.gate_bias)
    m = gate * (c_pred @ br.value_proj.t())  # [B, A, BS-1, M]
    x = out.x_last[:, :, 1:] + out.rms[:, :, 1:, None] * (m @ br.write_proj[-1].t())
    return drafter.norm(x)


def block_labels(tokens: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """Labels of the blocks at ``anchors [B, A]`` -> ``(labels, preds, valid)``, each [B, A, BS-1].

    Row k (1..BS-1) of anchor a is labelled with the target's greedy token after x[..a+k-1],
    ``greedy[a+k-1]``; its true predecessor is ``preds = x[a+k-1]`` (row 1: the anchor). The label is
    the target's greedy CONTINUATION from the anchor only while the sequence itself follows the
    target's greedy path (x[a+j] == greedy[a+j-1] for 1 <= j < k): always inside a generated
    continuation; in prompt text until the text first departs from the target's choice (that row
    still counts, its label is the target's token). ``valid`` marks those rows."""
    idx = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)  # a .. a+BS-2
    preds = tokens.gather(1, idx.flatten(1)).view_as(idx)
    labels = greedy.gather(1, idx.flatten(1)).view_as(idx)
    agree = preds[:, :, 1:] == labels[:, :, :-1]  # x[a+j] == greedy[a+j-1], j = 1..BS-2
    valid = torch.cat([torch.ones_like(agree[:, :, :1]), agree.int().cumprod(-1).bool()], dim=-1)
    return labels, preds, valid


def soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """-sum_j probs_j log softmax(logits)[ids_j] over the last dim: logits [..., V]; ids, probs [..., k]."""
    return -(probs * logits.log_softmax(-1).gather(-1, ids)).sum(-1)


def block_losses(drafter: DSpineDrafter, features: torch.Tensor, tokens: torch.Tensor, greedy: torch.Tensor,
                 anchors: torch.Tensor, weights: torch.Tensor, soft: SoftLabels | None = None,
                 soft_weight: float = 0.5) -> dict:
    """Main and tail losses of the blocks at ``anchors [B, A]`` plus greedy-acceptance statistics.

    ``accept``: mean number of leading rows the serving greedy tail would get right (the label is among
    the K candidates of the parallel logits and wins the candidate-restricted tail score given the true
    predecessor); ``accept_main``: leading rows where the parallel argmax is right."""
    out = drafter.forward_train(features, tokens, anchors)
    labels, preds, valid = block_labels(tokens, greedy, anchors, drafter.args.block_size)  # [B, A, BS-1]
    w = weights * valid  # rows past the target's greedy path carry no label
    logits = drafter.logits(out.hidden[:, :, 1:])  # [B, A, BS-1, V]
    tail_logits = drafter.logits(tail_hidden(drafter, out, preds))
    V = logits.shape[-1]
    ce_main = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view_as(labels)
    ce_tail = F.cross_entropy(tail_logits.reshape(-1, V), labels.reshape(-1), reduction="none").view_as(labels)
    if soft is not None:  # the target's distribution at the same positions as the greedy labels
        soft_ids, soft_probs = soft.at_blocks(anchors, drafter.args.block_size)
        ce_main = (1 - soft_weight) * ce_main + soft_weight * soft_cross_entropy(logits, soft_ids, soft_probs)
        ce_tail = (1 - soft_weight) * ce_tail + soft_weight * soft_cross_entropy(tail_logits, soft_ids, soft_probs)
    with torch.no_grad():
        K = drafter.args.head_topk
        cand = logits.topk(K, dim=-1).indices  # [B, A, BS-1, K]
        in_cand = (cand == labels[..., None]).any(-1)
        tail_pick = cand.gather(-1, tail_logits.gather(-1, cand).argmax(-1, keepdim=True)).squeeze(-1)
        hit_tail = in_cand & (tail_pick == labels) & valid
        hit_main = (logits.argmax(-1) == labels) & valid
    return {
        "main": (ce_main * w).sum(-1).mean(),
        "tail": (ce_tail * w).sum(-1).mean(),
        "accept": hit_tail.int().cumprod(-1).sum(-1).float().mean(),
        "accept_main": hit_main.int().cumprod(-1).sum(-1).float().mean(),
        "top1_row1": hit_main[..., 0].float().mean(),
    }


def _uniform(lo: torch.Tensor, hi: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """[B, n] integers uniform in [lo, hi] (inclusive, per row)."""
    span = (hi - lo + 1).clamp(min=1)
    u = torch.rand(len(lo), n, generator=generator)
    return lo[:, None] + (u * span[:, None]).long().clamp(max=span[:, None] - 1)


def sample_anchors(prompt_len: torch.Tensor, seq_len: int, block_size: int, per_seq: int,
                   generator: torch.Generator, early_frac: float = 0.0, early_span: int = 32,
                   text_anchors: bool = False) -> torch.Tensor:
    """[B, per_seq] anchors. ``round(early_frac * per_seq)`` of them uniform in the first ``early_span``
    positions of the continuation [P - 1, P - 2 + early_span] (where speculative decoding spends most of
    its cycles), the rest uniform over the continuation [P - 1, seq_len - block_size] (all labels are
    target output), or with ``text_anchors`` over the whole sequence [1, seq_len - block_size] (prompt
    text included, see ``block_labels``). With the defaults this draws exactly one ``[B, per_seq]``
    uniform tensor from ``generator``, as the recipe of the shipped drafter did."""
    hi = torch.full_like(prompt_len, seq_len - block_size)
    n_early = int(round(early_frac * per_seq))
    lo_cont = (prompt_len - 1).clamp(min=1).minimum(hi)
    parts = []
    if n_early:
        parts.append(_uniform(lo_cont, (lo_cont + early_span - 1).minimum(hi), n_early, generator))
    lo_rest = torch.ones_like(prompt_len).minimum(hi) if text_anchors else lo_cont
    parts.append(_uniform(lo_rest, hi, per_seq - n_early, generator))
    return torch.cat(parts, dim=1)


def _lr_at(step: int, cfg: DraftTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def simulate_greedy_cycles(drafter, features, tokens, greedy, prompt_len: int, new_tokens: int,
                           chunk: int = 4) -> dict:
    """Greedy speculative decoding replayed offline on target-greedy sequences (prompt ``prompt_len``,
    then the target's continuation): the first block is anchored at the first generated token, each
    cycle accepts the leading rows the serving tail gets right (label among the K candidates and
    winning the candidate-restricted conditional score, as ``tail.propose`` with exact retrieval), and
    the next block is anchored at the target's correction / bonus token. Returns the mean accepted
    length per cycle (what ``bench_engine`` reports for the same sequences) and the cycle count."""
    BS = drafter.args.block_size
    N, L = tokens.shape
    last = min(prompt_len + new_tokens, L - BS + 1)
    anchors = torch.arange(prompt_len, last).expand(N, -1)
    accepted = []
    for i in range(0, N, chunk):
        sl = slice(i, i + chunk)
        out = drafter.forward_train(features[sl].float(), tokens[sl], anchors[sl])
        labels, preds, valid = block_labels(tokens[sl], greedy[sl], anchors[sl], BS)
        logits = drafter.logits(out.hidden[:, :, 1:])
        tail_logits = drafter.logits(tail_hidden(drafter, out, preds))
        cand = logits.topk(drafter.args.head_topk, dim=-1).indices
        pick = cand.gather(-1, tail_logits.gather(-1, cand).argmax(-1, keepdim=True)).squeeze(-1)
        hit = (cand == labels[..., None]).any(-1) & (pick == labels) & valid
        accepted.append(hit.int().cumprod(-1).sum(-1))  # [chunk, A]
    acc = torch.cat(accepted)
    cycles = []
    for b in range(N):
        a = 0
        while a < acc.shape[1] - 1:  # stop when the sequence's budget is used up
            k = int(acc[b, a])
            cycles.append(k)
            a += k + 1
    return {"cycle_accept": sum(cycles) / max(1, len(cycles)), "cycles": len(cycles),
            "block_accept_mean": float(acc.float().mean())}


# ----------------------------------------------------------------------------- recipe
_print = functools.partial(print, flush=True)  # the CLI's log usually goes to a file


def train_draft(cfg: DraftTrainConfig, log=_print) -> dict:
    """Generate (or load) the distillation data, train the drafter, save it to ``cfg.out_dir``."""
    if cfg.soft_label_topk < 0 or not 0.0 <= cfg.soft_label_weight <= 1.0:
        raise ValueError(f"soft_label_topk / soft_label_weight: need topk >= 0 and weight in [0, 1], got "
                         f"{cfg.soft_label_topk} / {cfg.soft_label_weight}")
    t0 = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    target_dir, out = Path(cfg.target_dir), Path(cfg.out_dir)
    target = load_target(target_dir).eval().requires_grad_(False)
    tokenizer = Tokenizer.from_dir(target_dir)
    args = DraftArgs.for_target(target.args, **{**TINY_DRAFTER, **dict(cfg.model_overrides)})
    taps = tuple(args.feature_layers)
    if max(*cfg.prompt_lens, cfg.eval_prompt_len) > cfg.seq_len - args.block_size + 1:
        raise ValueError(f"prompt_lens {cfg.prompt_lens} / eval_prompt_len {cfg.eval_prompt_len}: need "
                         f"<= seq_len - block_size + 1 = {cfg.seq_len - args.block_size + 1} (labels are target output)")

    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else out / "distill_cache"
    # Every data setting but the count; the cache file's name adds the count.
    settings = json.dumps([_target_fingerprint(target_dir), cfg.seq_len, list(cfg.prompt_lens), cfg.gen_batch,
                           cfg.seed, cfg.max_files])
    tag = hashlib.sha256(json.dumps([settings, cfg.num_sequences]).encode()).hexdigest()[:12]
    tokens, prompt_len = distillation_data(target, tokenizer, "train", cfg.num_sequences, cfg, cfg.seed,
                                           cache_dir / f"train-{tag}.safetensors", log, settings)
    gen_seconds = time.time() - t0
    features, greedy, soft = target_pass(target, tokens, taps, soft_topk=cfg.soft_label_topk)
    on_path = (tokens[:, 1:] == greedy[:, :-1]).float().mean()
    log(f"distillation data: {tokens.shape[0]} sequences x {tokens.shape[1]} tokens "
        f"({int((tokens.shape[1] - prompt_len).sum()):,} target-greedy tokens; {100 * on_path:.1f}% of all next "
        f"tokens equal the target's argmax), features {tuple(features.shape)} bf16; "
        f"data ready after {time.time() - t0:.0f} s")

    drafter = DSpineDrafter(args, target.embed_tokens, target.lm_head_weight)
    drafter.init_weights(torch.Generator().manual_seed(cfg.seed))
    drafter.train()
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {n_params:,} parameters ({args.num_layers} layers, H {args.hidden_size}, D {args.code_dim}, "
        f"M {args.message_dim}, window {args.window}, taps {taps})")
    no_decay = {"bridge.codebook", "bridge.gate_bias", "mask_embedding"}
    decay = [p for n, p in drafter.named_parameters() if p.dim() >= 2 and n not in no_decay]
    rest = [p for n, p in drafter.named_parameters() if p.dim() < 2 or n in no_decay]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    weights = row_weights(args.block_size - 1, cfg.decay_gamma)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    N, L = tokens.shape
    history, first, last = [], None, None
    train_start = time.time()
    progress = Progress(cfg.steps, "train draft", unit="steps")
    for step in range(cfg.steps):
        lr = _lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, N, (min(cfg.batch_size, N),), generator=g)
        anchors = sample_anchors(prompt_len[idx], L, args.block_size, cfg.anchors_per_seq, g,
                                 cfg.early_frac, cfg.early_span, cfg.text_anchors)
        res = block_losses(drafter, features[idx].float(), tokens[idx], greedy[idx], anchors, weights,
                           soft[idx] if soft is not None else None, cfg.soft_label_weight)
        loss = res["main"] + cfg.tail_weight * res["tail"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        optimizer.step()
        row = {"step": step, "loss": loss.item(), "main": res["main"].item(), "tail": res["tail"].item(),
               "accept": res["accept"].item(), "accept_main": res["accept_main"].item()}
        first = first or row
        history.append(row)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            recent = history[-cfg.log_every:]
            mean = {k: sum(r[k] for r in recent) / len(recent) for k in ("loss", "main", "tail", "accept")}
            rate = (time.time() - train_start) / (step + 1)
            log(f"step {step:5d}  loss {mean['loss']:.3f} (main {mean['main']:.3f}, tail {mean['tail']:.3f})  "
                f"accept {mean['accept']:.2f}  lr {lr:.2e}  {rate:.2f} s/step")
            last = mean
        progress.update(1, loss=round(row["loss"], 3), accept=round(row["accept"], 2))
    progress.close()
    train_seconds = time.time() - train_start
    drafter.eval()
    # The shipped weights are BF16; the held-out estimate below reads exactly those.
    save_drafter(drafter.to(torch.bfloat16), out)
    drafter.float()

    summary = {
        "steps": cfg.steps, "seed": cfg.seed, "parameters": n_params,
        "first_loss": first["loss"] if first else None, "final_loss": last["loss"] if last else None,
        "final_train_accept": last["accept"] if last else None,
        "num_sequences": int(N), "seq_len": int(L), "data_seconds": gen_seconds,
        "train_seconds": train_seconds, "config": {k: (list(v) if isinstance(v, tuple) else v)
                                                   for k, v in asdict(cfg).items()},
        "draft_args": args.to_config(),
    }
    if cfg.eval_sequences:
        ev_len = cfg.eval_prompt_len + cfg.eval_new_tokens + args.block_size
        ev_cfg = dataclasses.replace(cfg, prompt_lens=(cfg.eval_prompt_len,), seq_len=ev_len)
        ev_tag = f"{tag}-{cfg.eval_sequences}-{cfg.eval_prompt_len}-{ev_len}"
        ev_tokens, _ = distillation_data(target, tokenizer, "heldout", cfg.eval_sequences, ev_cfg, cfg.seed,
                                         cache_dir / f"heldout-{ev_tag}.safetensors", log)
        ev_feats, ev_greedy, _ = target_pass(target, ev_tokens, taps)
        ev = simulate_greedy_cycles(drafter, ev_feats, ev_tokens, ev_greedy, cfg.eval_prompt_len, cfg.eval_new_tokens)
        summary["heldout"] = ev
        log(f"held-out greedy speculative decoding replayed offline ({cfg.eval_sequences} prompts of "
            f"{cfg.eval_prompt_len} tokens, {cfg.eval_new_tokens} new tokens): mean accepted length "
            f"{ev['cycle_accept']:.2f} per cycle over {ev['cycles']} cycles")
    summary["total_seconds"] = time.time() - t0
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"drafter saved to {out} ({summary['total_seconds']:.0f} s)")
    return summary
