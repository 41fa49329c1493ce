"""The target's plain layers: (zero-centred) RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .target_config import TargetArgs


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


class MLP(nn.Module):
    def __init__(self, args: TargetArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
