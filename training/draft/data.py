"""The distillation data: prompts from the train split, the target's continuations (greedy or sampled), the on-disk cache."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspine.progress import Progress
from dspine.replica.tokenizer import Tokenizer

from .. import corpus
from .config import DraftTrainConfig
from .continuations import sample_continuations


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def target_fingerprint(target_dir: Path) -> str:
    """16 hex digits naming the target's weights, config and tokenizer: the cache key's first part
    (a retrained target never reads another target's continuations)."""
    parts = sorted(target_dir.glob("*.safetensors")) + [target_dir / "config.json", target_dir / "tokenizer.json"]
    return hashlib.sha256("".join(_file_digest(p) for p in parts if p.exists()).encode()).hexdigest()[:16]


def continuation_seed(seed: int, first_row: int) -> int:
    """The seed of the generation batch starting at row ``first_row`` (sampled continuations only)."""
    return seed * 1_000_003 + first_row + 1


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
        # Each batch draws from its own seeded generator, so a cached smaller run stays a prefix of a larger one.
        generator = (torch.Generator().manual_seed(continuation_seed(seed, b0))
                     if cfg.continuation_temperature > 0 else None)
        rows.append(sample_continuations(target, batch, cfg.seq_len, cfg.continuation_temperature, generator))
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

