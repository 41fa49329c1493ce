"""A tiny DSpine drafter distilled toward a tiny test target in seconds.

A random drafter almost never proposes what the target would, so speculative
runs with it accept 0 tokens in nearly every cycle and mid-block rejection,
bonus tokens after a partial verify and the tail's chain of conditionals are
barely exercised. The drafter built here is trained for a few hundred steps
on the target's own continuations, through the real ``forward_train`` and
the tail's last-write rescoring, so the engine's whole draft path (pool,
block attention, bridge, tail tables, chain, retrieval) runs with realistic,
partial acceptance.

Labels are the target's full next-token distribution at ``temperature`` on
continuations sampled at that temperature (greedy when 0): at row k the
drafter learns the target's distribution after the actual sequence, whose
average over the unseen intermediate tokens is the marginal the drafter needs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dspine.replica.models.dspine import DSpineDrafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.train.draft import row_weights, tail_hidden

from .models import make_predictable_target


@torch.no_grad()
def sample_continuations(target, prompts: torch.Tensor, total_len: int, temperature: float,
                         generator: torch.Generator) -> torch.Tensor:
    """prompts [B, P] -> [B, total_len]: the prompt, then tokens drawn from the target at
    ``temperature`` (argmax when 0), decoded with the stateful forward_step / commit."""
    b, p = prompts.shape
    out = torch.empty(b, total_len, dtype=torch.long)
    out[:, :p] = prompts
    states = [target.new_state() for _ in range(b)]
    step = target.forward_step(prompts, states)
    target.commit(states, [p] * b)
    for t in range(p, total_len):
        logits = step.logits[:, -1].float()
        if temperature > 0:
            nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)
        out[:, t] = nxt
        if t + 1 < total_len:
            step = target.forward_step(nxt[:, None], states)
            target.commit(states, [1] * b)
    for state in states:
        state.free()
    return out


def distill_drafter(target, *, temperature: float = 1.0, window: int = 64, num_sequences: int = 96,
                    prompt_len: int = 6, seq_len: int = 72, steps: int = 300, batch_size: int = 16,
                    anchors_per_seq: int = 8, lr: float = 3e-3, seed: int = 0, **draft_overrides) -> DSpineDrafter:
    """Train a tiny drafter for ``target`` (eval mode on return). A few seconds on one CPU thread."""
    generator = torch.Generator().manual_seed(seed)
    target = target.eval()
    vocab = target.args.vocab_size
    args = DraftArgs.for_target(target.args, window=window, num_retrieve=min(32, vocab), **draft_overrides)
    prompts = torch.randint(0, vocab, (num_sequences, prompt_len), generator=generator)
    tokens = sample_continuations(target, prompts, seq_len, temperature, generator)
    with torch.no_grad():
        out = target(tokens, feature_layers=tuple(args.feature_layers))
        features = out.features.float()
        scale = temperature if temperature > 0 else 0.3  # greedy: a sharpened distribution as soft label
        target_probs = (out.logits.float() / scale).softmax(-1)  # [N, L, V]: next token after x[..t]

    drafter = DSpineDrafter(args, target.embed_tokens, target.lm_head_weight)
    drafter.init_weights(torch.Generator().manual_seed(seed))
    drafter.train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    block = args.block_size
    weights = row_weights(block - 1, gamma=7.0)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * (1 - step / steps))
        idx = torch.randint(0, num_sequences, (batch_size,), generator=generator)
        # anchors at or after the prompt's last token, with a full block of labels after them
        anchors = torch.randint(prompt_len - 1, seq_len - block + 1, (batch_size, anchors_per_seq), generator=generator)
        rows = anchors[..., None] + torch.arange(block - 1)  # [B, A, BS-1]: row k predicts the token after x[..a+k-1]
        seq_tokens = tokens[idx]
        flat = rows.flatten(1)
        preds = seq_tokens.gather(1, flat).view_as(rows)
        labels = target_probs[idx].gather(1, flat[..., None].expand(-1, -1, vocab)).view(*rows.shape, vocab)
        draft_out = drafter.forward_train(features[idx], seq_tokens, anchors)
        main = drafter.logits(draft_out.hidden[:, :, 1:])
        tail = drafter.logits(tail_hidden(drafter, draft_out, preds))
        loss = sum(-(labels * F.log_softmax(logits, -1)).sum(-1) for logits in (main, tail))  # [B, A, BS-1]
        loss = (loss * weights).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
    return drafter.eval().requires_grad_(False)


@functools.lru_cache(maxsize=8)
def distilled_pair(preset: str = "tiny", vocab_size: int = 64, sharpness: float = 3.0, window: int = 64,
                   steps: int = 200, seed: int = 0):
    """``(target, drafter)``: a predictable tiny target and a drafter distilled toward it at temperature 1
    (cached for the session: the models are read-only in the engine)."""
    target = make_predictable_target(preset, seed=seed, sharpness=sharpness, vocab_size=vocab_size)
    drafter = distill_drafter(target, temperature=1.0, window=window, steps=steps, batch_size=8,
                              anchors_per_seq=4, seed=seed)
    return target, drafter
