"""Tiny random models for tests, built in milliseconds."""

from __future__ import annotations

import torch

from dspine.replica.models.target import TargetModel
from dspine.replica.models.target_config import TARGET_CONFIGS, TargetArgs


def make_target(preset: str = "tiny", seed: int = 0, **overrides) -> TargetModel:
    """A tiny random target; weights larger than the default init so greedy choices are not near-ties."""
    torch.manual_seed(seed)
    model = TargetModel(TargetArgs(**{**TARGET_CONFIGS[preset], **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "conv1d" not in name:
                param.normal_(0.0, 0.08)
    return model.eval()


def make_predictable_target(preset: str = "tiny", seed: int = 0, sharpness: float = 3.0, **overrides) -> TargetModel:
    """A tiny random target whose next-token distributions a tiny drafter can learn in seconds.

    The token embedding (tied to the LM head in the tiny presets) is scaled by ``sharpness``: the
    logits get sharper (entropy about 1.8 nats over 64 tokens at 3.0, against nearly uniform at
    1.0) and the current token weighs more in the residual stream, while attention and the GDN
    layers still move the distribution by a total variation of 0.2-0.6 between contexts."""
    model = make_target(preset, seed=seed, **overrides)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(sharpness)
    return model
