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
