"""The optimiser and its learning-rate schedule (AdamW, linear warmup then cosine to ``min_lr``)."""

from __future__ import annotations

import math

import torch

from .config import DraftTrainConfig


def build_optimizer(drafter: torch.nn.Module, cfg: DraftTrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on the codebook, gate bias or mask embedding)."""
    no_decay = {"bridge.codebook", "bridge.gate_bias", "mask_embedding"}
    decay = [p for n, p in drafter.named_parameters() if p.dim() >= 2 and n not in no_decay]
    rest = [p for n, p in drafter.named_parameters() if p.dim() < 2 or n in no_decay]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def lr_at(step: int, cfg: DraftTrainConfig) -> float:
    """The learning rate of ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))

