"""One stateless forward of the frozen target over the distillation data: the drafter's inputs and labels."""

from __future__ import annotations

import torch

from .labels import SoftLabels


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

