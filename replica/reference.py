"""The naive oracle: greedy target-only generation that recomputes the whole sequence every step.

No state survives between steps (each step is `TargetModel.forward` on the
full sequence from scratch), so it shares no K/V or GDN-state bookkeeping with
the serving path; the speculative engine at temperature 0 must emit exactly
these tokens. Greedy = argmax of the fp32 logits, ties to the lower id.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .models.target import TargetModel


@torch.no_grad()
def reference_generate(model: TargetModel, prompt_ids: Iterable[int], max_new_tokens: int,
                       eos_token_ids: Iterable[int] = ()) -> list[int]:
    """Greedy continuation of `prompt_ids`: the new tokens only, ending with the eos token if one was produced."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty; the target needs at least one token to condition on")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = {int(t) for t in eos_token_ids}
    device = model.embed_tokens.weight.device
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids + new], device=device)).logits[0, -1]  # (V,)
        token = int(torch.argmax(logits))  # first maximum: ties go to the lower id
        new.append(token)
        if token in eos:
            break
    return new
