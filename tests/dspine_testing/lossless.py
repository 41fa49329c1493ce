"""Goodness of fit of an engine's sampled output to the target's sampling distribution.

Speculative sampling is lossless iff every emitted token is distributed as the
target's p(. | prefix) after the request's temperature / top-k / top-p,
whatever the drafter proposed. A test therefore needs no enumeration of
sequences: one teacher-forced target forward over each sampled sequence gives
p_n for every position n, and under the null hypothesis the token at n is a
draw from p_n given everything before it. Two Pearson statistics pool all
positions of all samples:

* **token identity**: the count of each token id against the sum of p_n(id);
* **rank**: the count of tokens emitted at rank r of p_n (descending, ties to
  the lower id) against the sum of p_n's r-th largest entry.

The cells' variances under the null are at most those of a multinomial with
the same means (the p_n differ from position to position), so the p-values
are conservative. A token the target gives probability 0 (outside top-k /
top-p) makes a cell with zero expectation observed, and the p-value 0.

The engine's incremental forward and the teacher-forced one agree only to
rounding, so a position whose top-k or top-p boundary is a near tie (two
logits within 1e-4, or a cumulative mass within 1e-6 of top_p) could keep a
token in one and drop it in the other. Such positions are left out; whether a
position is left out depends only on its prefix, never on the token drawn
there, so the test stays exact for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspine.replica import sampling
from dspine.replica.sampling import SamplingParams

from .stats import chi_square_pvalue


@dataclass(frozen=True)
class FitResult:
    token_pvalue: float
    rank_pvalue: float
    num_tokens: int
    num_ambiguous: int  # positions left out: near-tied top-k / top-p boundary

    @property
    def pvalue(self) -> float:
        """The smaller of the two p-values, Bonferroni-corrected for two tests."""
        return min(1.0, 2 * min(self.token_pvalue, self.rank_pvalue))


_LOGIT_TIE = 1e-4
_MASS_TIE = 1e-6


def _near_tied_boundary(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N] bool: the kept set of ``logits [N, V]`` under ``params`` hinges on rounding."""
    z = logits.sort(dim=1, descending=True).values / params.temperature
    vocab = z.shape[1]
    tied = torch.zeros(z.shape[0], dtype=torch.bool)
    if params.min_p > 0:  # an entry within rounding of the min-p threshold max + log(min_p)
        tied |= ((z - z[:, :1] - math.log(params.min_p)).abs() < _LOGIT_TIE).any(1)
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k < vocab:
        tied |= (z[:, k - 1] - z[:, k]) < _LOGIT_TIE
    if params.top_p < 1.0:
        probs = torch.softmax(z[:, :k], dim=1)
        mass_before = probs.cumsum(1) - probs
        tied |= ((mass_before - params.top_p).abs() < _MASS_TIE).any(1)
    return tied


@torch.no_grad()
def target_probabilities(target, prompt: list[int], outputs: list[list[int]], params: SamplingParams):
    """For equal-length ``outputs`` after ``prompt``: ``(p [N, L, V] float64, near_tied [N, L] bool)``,
    p_n for every output position and whether its top-k / top-p boundary is a near tie."""
    tokens = torch.tensor([prompt + out for out in outputs])  # [N, P + L]
    length = len(outputs[0])
    logits = target(tokens[:, :-1]).logits[:, len(prompt) - 1:].double()  # [N, L, V]: row n predicts token n
    logits = _penalised(logits, prompt, torch.tensor(outputs), params)
    n, _, vocab = logits.shape
    flat = logits.reshape(n * length, vocab)
    temperature, top_k, top_p = sampling.batch_params([params] * (n * length))
    probs = sampling.probabilities(flat, temperature, top_k, top_p, min_p=params.min_p).view(n, length, vocab)
    return probs, _near_tied_boundary(flat, params).view(n, length)


def _penalised(logits: torch.Tensor, prompt: list[int], outputs: torch.Tensor, params: SamplingParams):
    """``logits [N, L, V]`` with the request's logit bias and penalties, position by position: position
    ``l`` sees the prompt and ``outputs[:, :l]`` (written independently of the engine's block-wise
    counts, as the definition in ``dspine.replica.logits_processors`` reads)."""
    n, length, vocab = logits.shape
    if (params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and not params.logit_bias):
        return logits
    out = logits.clone()
    for token_id, bias in params.logit_bias:
        out[:, :, token_id] += bias
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    in_prompt[torch.tensor(prompt)] = True
    for pos in range(length):
        counts = torch.stack([torch.bincount(outputs[i, :pos], minlength=vocab) for i in range(n)]).double()
        x = out[:, pos]
        seen = in_prompt[None, :] | (counts > 0)
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        out[:, pos] = x - params.presence_penalty * (counts > 0) - params.frequency_penalty * counts
    return out


def fit(target, samples: dict[tuple[int, ...], list[list[int]]], params: SamplingParams, first_position: int = 1,
        ) -> FitResult:
    """Fit of ``samples`` (prompt -> sampled outputs of one length) to the target at ``params``;
    positions before ``first_position`` are left out (position 0 comes from prefill, not speculation)."""
    vocab = target.args.vocab_size
    token_observed = torch.zeros(vocab, dtype=torch.float64)
    token_expected = torch.zeros(vocab, dtype=torch.float64)
    rank_observed = torch.zeros(vocab, dtype=torch.float64)
    rank_expected = torch.zeros(vocab, dtype=torch.float64)
    num_tokens = num_ambiguous = 0
    for prompt, outputs in samples.items():
        probs, tied = target_probabilities(target, list(prompt), outputs, params)
        emitted = torch.tensor(outputs)[:, first_position:].reshape(-1)  # [N * L']
        probs = probs[:, first_position:].reshape(-1, vocab)
        keep = ~tied[:, first_position:].reshape(-1)
        num_ambiguous += int((~keep).sum())
        probs, emitted = probs[keep], emitted[keep]
        token_observed += torch.bincount(emitted, minlength=vocab).double()
        token_expected += probs.sum(0)
        # rank of the emitted token: entries strictly larger, or equal with a lower id
        p_emitted = probs.gather(1, emitted[:, None])
        ids = torch.arange(vocab)
        ahead = (probs > p_emitted) | ((probs == p_emitted) & (ids[None, :] < emitted[:, None]))
        rank_observed += torch.bincount(ahead.sum(1), minlength=vocab).double()
        rank_expected += probs.sort(dim=1, descending=True).values.sum(0)
        num_tokens += len(emitted)
    return FitResult(
        token_pvalue=chi_square_pvalue(token_observed.tolist(), (token_expected / num_tokens).tolist()),
        rank_pvalue=chi_square_pvalue(rank_observed.tolist(), (rank_expected / num_tokens).tolist()),
        num_tokens=num_tokens,
        num_ambiguous=num_ambiguous,
    )
