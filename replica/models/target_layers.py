"""The target's RMSNorm (zero-centred for Qwen3.5); its MLP is models/swiglu.py, shared with the drafter."""

from __future__ import annotations

import torch
from torch import nn



class RMSNorm(nn.Module):
    """y = x_hat * (1 + w) when zero_centred (Qwen3.5), else w * x_hat (Qwen3); statistics in fp32."""

    def __init__(self, dim: int, eps: float, zero_centred: bool):
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (y * (1.0 + self.weight.float())).type_as(x)
        return self.weight * y.type_as(x)
