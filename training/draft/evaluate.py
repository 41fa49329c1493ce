"""The held-out estimates: greedy speculative decoding replayed offline, as ``dspine bench engine``
runs it, and the expected sampled acceptance of blocks on held-out sampled continuations."""

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



@torch.no_grad()
def target_probabilities(target, tokens: torch.Tensor, temperature: float, chunk: int = 8) -> torch.Tensor:
    """``[N, L, V]`` fp32: the target's full next-token distribution at ``temperature`` after every
    prefix of ``tokens [N, L]`` (held-out sets only: it is V floats per position)."""
    out = []
    for i in range(0, tokens.shape[0], chunk):
        logits = target(tokens[i : i + chunk]).logits.float()
        out.append((logits / temperature).softmax(-1))
    return torch.cat(out)


@torch.no_grad()
def expected_sampled_blocks(drafter, features, tokens, target_probs, prompt_len: int, new_tokens: int,
                            temperature: float, chunk: int = 4) -> dict:
    """The expected accepted length of a sampled speculative block anchored at every generated position
    of held-out sequences whose continuations the target sampled at ``temperature``.

    Row t of a block is accepted with probability ``alpha_t = sum_x min(p_t(x), q_t(x))``: p_t the
    target's FULL distribution at the temperature (``target_probs [N, L, V]``, never renormalised over
    a top k, which would overstate it), q_t the serving tail's (softmax of the tail scores over the K
    candidates of the parallel logits, at the same temperature, given the sequence's token as
    predecessor; exact retrieval). A block's expected accepted length is ``sum_k prod_{t<=k} alpha_t``.
    Unlike the training log's ``accept_sampled`` (training sequences, top-k soft labels), this reads
    text the drafter never saw, so it is the figure to compare with ``dspine bench engine``'s."""
    BS = drafter.args.block_size
    N, L = tokens.shape
    last = min(prompt_len + new_tokens, L - BS + 1)
    anchors = torch.arange(prompt_len, last).expand(N, -1)
    expected, row_alpha = [], []
    for i in range(0, N, chunk):
        sl = slice(i, i + chunk)
        out = drafter.forward_train(features[sl].float(), tokens[sl], anchors[sl])
        _, preds, _ = block_labels(tokens[sl], tokens[sl], anchors[sl], BS)  # [c, A, BS-1]: x[a+t-1]
        logits = drafter.logits(out.hidden[:, :, 1:])  # [c, A, BS-1, V]
        tail_logits = drafter.logits(tail_hidden(drafter, out, preds))
        cand = logits.topk(drafter.args.head_topk, dim=-1).indices  # [c, A, BS-1, K]
        q = (tail_logits.gather(-1, cand) / temperature).softmax(-1)
        idx = anchors[sl][..., None] + torch.arange(BS - 1)  # row t reads p after x[..a+t-1]
        c, _, r = idx.shape
        rows_of = torch.arange(c)[:, None, None, None]
        p = target_probs[sl][rows_of, idx[..., None], cand]  # [c, A, BS-1, K]: p at the candidates (q is 0 elsewhere)
        alpha = torch.minimum(p, q).sum(-1)  # [c, A, BS-1]
        row_alpha.append(alpha.reshape(-1, r))
        expected.append(alpha.cumprod(-1).sum(-1).reshape(-1))
    expected_len = torch.cat(expected)
    rows = torch.cat(row_alpha).mean(0)
    return {"block_accept_expected": float(expected_len.mean()), "blocks": int(expected_len.numel()),
            "temperature": temperature, "row_accept": [round(float(x), 4) for x in rows[:4]]}
