"""The held-out estimate: greedy speculative decoding replayed offline, as ``dspine bench engine`` runs it."""

from __future__ import annotations

import torch

from .labels import block_labels
from .losses import tail_hidden


@torch.no_grad()
def simulate_greedy_cycles(drafter, features, tokens, greedy, prompt_len: int, new_tokens: int,
                           chunk: int = 4) -> dict:
    """Greedy speculative decoding replayed offline on target-greedy sequences (prompt ``prompt_len``,
    then the target's continuation): the first block is anchored at the first generated token, each
    cycle accepts the leading rows the serving tail gets right (label among the K candidates and
    winning the candidate-restricted conditional score, as ``tail.propose`` with exact retrieval), and
    the next block is anchored at the target's correction / bonus token. Returns the mean accepted
    length per cycle (what ``bench_engine`` reports for the same sequences) and the cycle count."""
    BS = drafter.args.block_size
    N, L = tokens.shape
    last = min(prompt_len + new_tokens, L - BS + 1)
    anchors = torch.arange(prompt_len, last).expand(N, -1)
    accepted = []
    for i in range(0, N, chunk):
        sl = slice(i, i + chunk)
        out = drafter.forward_train(features[sl].float(), tokens[sl], anchors[sl])
        labels, preds, valid = block_labels(tokens[sl], greedy[sl], anchors[sl], BS)
        logits = drafter.logits(out.hidden[:, :, 1:])
        tail_logits = drafter.logits(tail_hidden(drafter, out, preds))
        cand = logits.topk(drafter.args.head_topk, dim=-1).indices
        pick = cand.gather(-1, tail_logits.gather(-1, cand).argmax(-1, keepdim=True)).squeeze(-1)
        hit = (cand == labels[..., None]).any(-1) & (pick == labels) & valid
        accepted.append(hit.int().cumprod(-1).sum(-1))  # [chunk, A]
    acc = torch.cat(accepted)
    cycles = []
    for b in range(N):
        a = 0
        while a < acc.shape[1] - 1:  # stop when the sequence's budget is used up
            k = int(acc[b, a])
            cycles.append(k)
            a += k + 1
    return {"cycle_accept": sum(cycles) / max(1, len(cycles)), "cycles": len(cycles),
            "block_accept_mean": float(acc.float().mean())}

