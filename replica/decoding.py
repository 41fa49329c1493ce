"""The model runner's request-option hooks: penalties, Gumbel mode and logprobs for a batch.

The runner calls these at the three places target logits become tokens
(prefill's first token, target-only steps, verification of a drafted block)
and where the drafter proposes, so each request option is applied the same way
on every path (see :mod:`logits_processors`, :mod:`gumbel`, :mod:`logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import gumbel, logits_processors, logprobs, sampling
from .request import Request

__all__ = ["next_positions", "processed_logits", "gumbel_tokens", "gumbel_verify_targets", "gumbel_proposal", "propose",
           "token_logprobs", "wants_logprobs"]


def next_positions(batch: Sequence[Request], device) -> torch.Tensor:
    """``[B]`` int64: the absolute position of each request's next token (prompt + output so far)."""
    return torch.tensor([len(r.prompt_token_ids) + len(r.output_token_ids) for r in batch], dtype=torch.int64,
                        device=device)


def processed_logits(logits: torch.Tensor, batch: Sequence[Request], block_ids: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """``logits [B, T, V]`` after each request's logit bias and penalties (unchanged when nobody has any);
    ``block_ids [B, T - 1]`` are the drafted tokens the rows after row 0 also count."""
    params = [r.params for r in batch]
    if not logits_processors.needs_processing(params):
        return logits
    counts = logits_processors.context_counts([r.prompt_token_ids for r in batch],
                                              [r.output_token_ids for r in batch], logits.shape[-1], logits.device)
    return logits_processors.process(logits, params, counts, block_ids)


def _seeds(batch: Sequence[Request], device) -> torch.Tensor:
    return torch.tensor([gumbel.seed_words(r.params.seed or 0) for r in batch], dtype=torch.int64, device=device)


def _filtered(logits: torch.Tensor, params: Sequence[sampling.SamplingParams]) -> torch.Tensor:
    temperature, top_k, top_p = sampling.batch_params(params, device=logits.device)
    return sampling.filter_logits(logits.to(torch.float64), temperature, top_k, top_p,
                                  sampling.batch_min_p(params, device=logits.device))


def gumbel_tokens(logits: torch.Tensor, batch: Sequence[Request]) -> torch.Tensor:
    """``ids [N]``: each request's Gumbel-argmax of its filtered ``logits [N, V]`` at its next position."""
    filtered = _filtered(logits, [r.params for r in batch])
    return gumbel.gumbel_argmax(filtered, _seeds(batch, logits.device), next_positions(batch, logits.device))


def gumbel_verify_targets(target_probs: torch.Tensor, logits: torch.Tensor, batch: Sequence[Request]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-mode rows of a verified block become exact-match rows: ``target_probs [NB, T, V]`` with
    each Gumbel request's rows one-hot on the target's Gumbel-argmax (position of row t = next
    position + t), and ``[NB]`` bool marking them (verify them with argmax semantics)."""
    nb, t, v = logits.shape
    rows = [b for b, r in enumerate(batch) if r.params.is_gumbel]
    mask = torch.zeros(nb, dtype=torch.bool, device=logits.device)
    if not rows:
        return target_probs, mask
    sub = [batch[b] for b in rows]
    params = [r.params for r in sub for _ in range(t)]
    filtered = _filtered(logits[rows].reshape(len(rows) * t, v), params)
    positions = (next_positions(sub, logits.device)[:, None] + torch.arange(t, device=logits.device)).reshape(-1)
    seeds = _seeds(sub, logits.device).repeat_interleave(t, dim=0)
    ids = gumbel.gumbel_argmax(filtered, seeds, positions).view(len(rows), t)
    target_probs = target_probs.clone()
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    target_probs[index] = torch.zeros(len(rows), t, v, dtype=target_probs.dtype, device=logits.device).scatter_(
        2, ids[..., None], 1.0)
    mask[index] = True
    return target_probs, mask


def propose(draft_out, tables, anchors: torch.Tensor, batch: Sequence[Request], generators, with_confidence: bool,
            num_coins: int | None = None):
    """:func:`tail.propose` for a batch holding Gumbel-mode requests: the same candidates and
    conditional tables, the ordinary chain for the others, :func:`gumbel_proposal` for them
    (``num_coins`` as for :func:`tail.propose`)."""
    from . import tail

    hidden = draft_out.hidden
    nb, bs, h = hidden.shape
    dev = hidden.device
    params = [r.params for r in batch]
    temperature, top_k, top_p = sampling.batch_params(params, device=dev)
    cand_ids, _ = tail.retrieve_candidates(hidden[:, 1:].reshape(nb * (bs - 1), h), tables)
    cand_ids = cand_ids.view(nb, bs - 1, -1)
    scores = tail.conditional_tables(draft_out, tables, anchors.to(dev), cand_ids)
    uniforms = tail.draw_chain_uniforms(generators, temperature, bs - 1, dev, num_coins)
    draft_ids, choice, q = tail.tail_chain(scores, cand_ids, temperature, top_k, top_p, uniforms)
    proposal = gumbel_proposal(tail.Proposal(draft_ids, q, cand_ids, choice), scores, batch)
    if with_confidence:
        proposal.confidence = tail.chain_confidence(scores, proposal.choice)
    return proposal


def gumbel_proposal(proposal, scores: torch.Tensor, batch: Sequence[Request]):
    """Replace the Gumbel requests' rows of ``proposal`` by the drafter's Gumbel-argmax chain over the
    same conditional tables ``scores [NB, T, K, K]`` (same noise as the target: high acceptance)."""
    rows = [b for b, r in enumerate(batch) if r.params.is_gumbel]
    if not rows:
        return proposal
    dev = scores.device
    sub = [batch[b] for b in rows]
    params = [r.params for r in sub]
    temperature, top_k, top_p = sampling.batch_params(params, device=dev)
    index = torch.tensor(rows, dtype=torch.int64, device=dev)
    # y_1 is the token after the anchor: the anchor is the last output token, so y_1 sits at the next position
    draft_ids, choice, q = gumbel.gumbel_chain(scores[index], proposal.cand_ids[index], temperature, top_k, top_p,
                                               _seeds(sub, dev), next_positions(sub, dev))
    proposal.draft_ids[index] = draft_ids.to(proposal.draft_ids.dtype)
    proposal.choice[index] = choice
    proposal.q[index] = q.to(proposal.q.dtype)
    return proposal


def wants_logprobs(batch: Sequence[Request]) -> bool:
    return any(r.params.logprobs is not None for r in batch)


def token_logprobs(logits: torch.Tensor, batch: Sequence[Request], tokens: Sequence[Sequence[int]]
                   ) -> dict[str, list[logprobs.TokenLogprobs]]:
    """Per request asking for logprobs: the entries of its emitted ``tokens[b]`` (token ``i`` read from
    row ``i`` of ``logits [B, T, V]``, which are already bias- and penalty-processed)."""
    out = {}
    for b, request in enumerate(batch):
        if request.params.logprobs is None or not tokens[b]:
            continue
        n = len(tokens[b])
        ids = torch.tensor(tokens[b], dtype=torch.int64, device=logits.device)
        out[request.request_id] = logprobs.compute(logits[b, :n], [request.params] * n, ids)
    return out
