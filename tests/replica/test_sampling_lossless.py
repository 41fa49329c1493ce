"""Sampled speculative decoding through the whole engine follows the target's distribution.

The first token comes from prefill (target only); the second and third come
from the first speculative cycle (the tail's 16-candidate proposal, then
verification). Their exact target marginals are computed by enumerating the
target's conditionals over a small vocabulary; a chi-square test compares the
engine's samples with them, and the same test rejects a deliberately broken
verifier that accepts every proposal.
"""

from __future__ import annotations

import pytest
import torch
from dspine_testing.stats import chi_square_pvalue

from dspine.replica import SamplingParams, sampling, verify

VOCAB = 24  # > head_topk (16): q is restricted to candidates, p is not
PROMPT = [3, 1, 4, 1, 5]
NUM_SAMPLES = 2400


def _exact_marginals(target, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """p(second token) and p(third token) under the target after the request's filtering."""
    temperature, top_k, top_p = sampling.batch_params([params])

    def probs_after(prefixes: torch.Tensor) -> torch.Tensor:  # [N, L] -> [N, V]
        logits = target(prefixes).logits[:, -1]
        n = logits.shape[0]
        return sampling.probabilities(logits, temperature.expand(n), top_k.expand(n), top_p.expand(n))

    with torch.no_grad():
        prompt = torch.tensor([PROMPT])
        p1 = probs_after(prompt)[0]  # [V]
        first = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)  # [V, L+1]
        p2_given_1 = probs_after(first)  # [V, V]
        second = torch.cat([first.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], dim=1)
        p3_given_12 = probs_after(second).view(VOCAB, VOCAB, VOCAB)
    p2 = p1 @ p2_given_1
    joint12 = p1[:, None] * p2_given_1  # [V, V]
    p3 = (joint12[..., None] * p3_given_12).sum(dim=(0, 1))
    return p2, p3


def _sample_tokens(build, target, params: SamplingParams) -> torch.Tensor:
    engine = build.engine(target, window=4)
    prompts = [PROMPT] * NUM_SAMPLES
    per_request = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(NUM_SAMPLES)]
    results = engine.generate_many(prompts, per_request, speculative=True)
    assert all(r.stats.spec.num_cycles >= 1 for r in results)
    return torch.tensor([r.token_ids[1:3] for r in results])  # [N, 2]


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=3, ignore_eos=True),
], ids=["plain", "temperature-topk-topp"])
def test_engine_samples_follow_the_target(build, params, monkeypatch):
    target = build.target("tiny", vocab_size=VOCAB)
    p2, p3 = _exact_marginals(target, params)
    tokens = _sample_tokens(build, target, params)
    for column, expected in ((0, p2), (1, p3)):
        counts = torch.bincount(tokens[:, column], minlength=VOCAB).tolist()
        assert chi_square_pvalue(counts, expected.tolist()) > 1e-3

    # The same test has the power to catch a verifier that accepts every proposal.
    def accept_everything(draft_ids, draft_q, target_probs, uniforms_accept, uniforms_resample, **_):
        return _all_accepted(draft_ids, target_probs, uniforms_resample)

    monkeypatch.setattr(verify, "verify_sampled", accept_everything)
    broken = _sample_tokens(build, target, params)
    counts = torch.bincount(broken[:, 0], minlength=VOCAB).tolist()
    assert chi_square_pvalue(counts, p2.tolist()) < 1e-6


def _all_accepted(draft_ids, target_probs, uniforms_resample):
    """A broken verifier: every draft token accepted, then a bonus from p."""
    b, k = draft_ids.shape
    bonus = sampling.sample(target_probs[:, k], uniforms_resample)
    output = torch.cat([draft_ids, bonus[:, None]], dim=1).to(torch.int32)
    accepted = torch.full((b,), k, dtype=torch.int64)
    return verify.VerifyResult(output_ids=output, accepted_len=accepted, num_emitted=accepted + 1)
