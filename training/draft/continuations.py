"""The target's own continuations of prompts, decoded with the batched stateful API."""

from __future__ import annotations

import torch


@torch.no_grad()
def sample_continuations(target, prompts: torch.Tensor, total_len: int, temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """prompts [B, P] -> [B, total_len]: the prompt followed by the target's tokens at ``temperature``
    (greedy when 0: argmax, ties to the lower id; else drawn from ``generator``), decoded with one
    prefill then one ``forward_step`` + ``commit`` per token.

    Greedy continuations are the drafter recipe's labels (distillation data); sampled ones are what
    the test suite's quick distillation (tests/dspine_testing/distill.py) trains on."""
    B, P = prompts.shape
    out = torch.empty(B, total_len, dtype=torch.long)
    out[:, :P] = prompts
    if total_len == P:
        return out
    states = [target.new_state() for _ in range(B)]
    step = target.forward_step(prompts, states)
    target.commit(states, [P] * B)
    for t in range(P, total_len):
        logits = step.logits[:, -1].float()  # [B, V]; exact for fp32 and bf16 logits, so argmax is unchanged
        if temperature > 0:
            nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)  # ties -> lower id
        out[:, t] = nxt
        if t + 1 < total_len:
            step = target.forward_step(nxt[:, None], states)
            target.commit(states, [1] * B)
    for s in states:
        s.free()
    return out
