"""Train the tiny Qwen3.5-style hybrid target from scratch on the stdlib corpus.

Deterministic for a given seed and step count on one machine: the token
stream, the window sampling and the initialisation all come from seeded
generators. The result is saved as an HF-format directory (config.json,
model.safetensors, tokenizer.json) that ``load_target`` reads like any
released checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dspine.progress import Progress
from dspine.replica.models.loader import save_target
from dspine.replica.models.target import TargetModel
from dspine.replica.models.target_config import TargetArgs
from . import corpus
from .tokenizer import END_OF_TEXT, train_tokenizer

# The embedded target's geometry: a hybrid of Gated DeltaNet layers and gated
# full attention (every 3rd layer here; the 27B has every 4th), 6.2M parameters.
TINY_TARGET = dict(
    model_type="qwen3_5_text",
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    partial_rotary_factor=0.25,
    rope_theta=10_000.0,
    full_attention_interval=3,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    feature_layers=(1, 2, 3, 4, 5),
)


@dataclass(frozen=True)
class TargetTrainConfig:
    out_dir: str
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    vocab_size: int = 4096
    seed: int = 0
    threads: int = 0  # 0 -> torch's default
    max_files: int | None = None  # limit the corpus (pipeline tests)
    model_overrides: tuple = ()  # (key, value) pairs over TINY_TARGET


def tokenize_corpus(tokenizer, split: str, max_files: int | None = None) -> torch.Tensor:
    """All files of the split as one int32 stream, files separated by <|endoftext|>."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(corpus.read_texts(split, max_files=max_files)):
        ids.extend(encoding.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def _lr_at(step: int, cfg: TargetTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _batch(stream: torch.Tensor, cfg: TargetTrainConfig, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
    return torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def perplexity(model: TargetModel, stream: torch.Tensor, seq_len: int = 256, max_windows: int = 64) -> float:
    """Token perplexity over consecutive windows of a held-out stream."""
    model.eval()
    losses = []
    for i in range(min(max_windows, (len(stream) - 1) // seq_len)):
        window = stream[i * seq_len : (i + 1) * seq_len + 1].long()[None]
        logits = model(window[:, :-1]).logits
        losses.append(F.cross_entropy(logits[0], window[0, 1:]).item())
    return math.exp(sum(losses) / len(losses))


def train_target(cfg: TargetTrainConfig, log=None) -> dict:
    """Train tokenizer + target, save to ``cfg.out_dir``; returns a summary dict."""
    log = log or (lambda message: print(message, flush=True))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    tokenizer = train_tokenizer(corpus.read_texts("train", max_files=cfg.max_files), cfg.vocab_size, out)
    train_stream = tokenize_corpus(tokenizer, "train", cfg.max_files)
    heldout_stream = tokenize_corpus(tokenizer, "heldout", cfg.max_files)
    eot = tokenizer.token_to_id(END_OF_TEXT)
    log(f"corpus: {len(train_stream):,} train tokens, {len(heldout_stream):,} held-out tokens")

    fields = dict(TINY_TARGET, vocab_size=tokenizer.get_vocab_size(), eos_token_id=(eot,))
    fields.update(dict(cfg.model_overrides))
    args = TargetArgs(**fields)
    model = TargetModel(args)
    _init_weights(model, cfg.seed)
    log(f"target: {sum(p.numel() for p in model.parameters()):,} parameters")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(cfg.seed)
    start = time.time()
    model.train()
    progress = Progress(cfg.steps, "train target", unit="steps")
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        batch = _batch(train_stream, cfg, generator)
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            elapsed = time.time() - start
            tokens_per_s = (step + 1) * cfg.batch_size * cfg.seq_len / elapsed
            log(f"step {step:5d}  loss {loss.item():.3f}  lr {_lr_at(step, cfg):.2e}  {tokens_per_s:,.0f} tok/s")
        progress.update(1, loss=round(loss.item(), 3))
    progress.close()
    model.eval()
    # The shipped weights are BF16 (half the size); perplexity is measured on exactly those.
    save_target(model.to(torch.bfloat16), out)
    ppl = perplexity(model.float(), heldout_stream, cfg.seq_len)
    summary = {"heldout_perplexity": ppl, "steps": cfg.steps, "train_seconds": time.time() - start,
               "parameters": sum(p.numel() for p in model.parameters()), "seed": cfg.seed}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"held-out perplexity {ppl:.2f}; saved to {out}")
    return summary


def _init_weights(model: TargetModel, seed: int) -> None:
    """GPT-2 style init: normal(0, 0.02) for matrices, residual outputs scaled by depth."""
    generator = torch.Generator().manual_seed(seed)
    num_layers = model.args.num_layers
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "conv1d" not in name:
                std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif name.endswith("A_log"):  # per-head decay rates spread as in the Qwen3.5 release
                param.copy_(torch.empty(param.shape).uniform_(1.0, 16.0, generator=generator).log())
