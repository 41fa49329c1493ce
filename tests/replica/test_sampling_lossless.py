"""Sampled speculative decoding through the whole engine follows the target's distribution.

The drafter is distilled toward the test target in seconds
(``dspine_testing.distill``), so the real draft path (pool, block attention,
bridge, tail tables, chain, retrieval) proposes with substantial, partial
acceptance: cycles end anywhere from row 0 to a bonus after row 15, and
dynamic verification truncates blocks. Each case samples 200 seeded requests
on each of 4 prompts, 24 new tokens each (about 18,000 speculatively emitted
tokens), and fits every emitted token to the target's own p(. | prefix) after
the request's temperature / top-k / top-p (``dspine_testing.lossless``).

The same test is then run with each deliberate bug of ``dspine.faults``
injected into the engine, and must fail: a test that passes a broken engine
proves nothing.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import pytest
import torch
from dspine_testing.distill import distilled_pair
from dspine_testing.lossless import FitResult, fit

from dspine import faults
from dspine.replica import Engine, EngineConfig, SamplingParams

SEEDS_PER_PROMPT = 200
NEW_TOKENS = 24
PASS_PVALUE = 1e-4  # the real engine; cases are deterministic (seeded), so this is about margin
FAIL_PVALUE = 1e-6  # a broken engine


@dataclass(frozen=True)
class Case:
    params: SamplingParams
    verify_threshold: float  # 0: whole-block verification
    adaptive: bool = False  # adaptive speculation (the policy picks rows per request and step)
    # accepted rows per cycle the case must reach (penalties: the drafter proposes without them)
    min_mean_accepted: float = 0.9


CASES = {
    # whole blocks, plain sampling: acceptance 1.7 per cycle, cycles ending at every row
    "whole-block": Case(SamplingParams(temperature=1.0), 0.0),
    # dynamic verification cut short (threshold 0.5): most blocks are truncated, and a truncated
    # block accepted in full ends with a bonus drawn from p
    "dynamic": Case(SamplingParams(temperature=1.0, top_k=6), 0.5),
    # the target's filtering at work in p: temperature, top-k and a top-p that cuts
    "temperature-topk-topp": Case(SamplingParams(temperature=0.7, top_k=12, top_p=0.9), 0.05),
    # the shipped configuration: adaptive speculation on top of the confidence cut, with top-p
    "adaptive": Case(SamplingParams(temperature=0.7, top_p=0.9), 0.05, adaptive=True),
    # penalties and a logit bias (row t of a block counts the tokens drafted before it), with min-p
    "penalties-minp": Case(SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3,
                                          presence_penalty=0.5, frequency_penalty=0.4,
                                          logit_bias={3: 1.0, 8: -2.0}), 0.0, min_mean_accepted=0.4),
    # seed-reproducible (Gumbel-max) sampling: exact-match verification against the target's noise
    "gumbel": Case(SamplingParams(temperature=0.7, top_p=0.9, reproducible=True, seed=0), 0.0),
}

# Each bug and the case built to expose it.
BROKEN = {
    "verify.always_accept": "whole-block",
    "verify.recover_from_p": "whole-block",
    "tail.q_from_wrong_row": "whole-block",
    "verify.bonus_from_residual": "dynamic",
    "tail.confidence_reads_own_draw": "dynamic",
    "runner.p_without_temperature": "temperature-topk-topp",
    "runner.p_without_top_p": "temperature-topk-topp",
    "penalties.same_counts_for_every_row": "penalties-minp",
    "gumbel.noise_halved": "gumbel",
}


@dataclass
class Run:
    fit: FitResult
    cycles: list[tuple[int, int]]  # (rows verified, rows accepted) of every speculative cycle


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (3, 7, 12, 20)]


def _cost_like_a_gpu(costs) -> None:
    """Feed the policy the step costs of a machine where a verify row is nearly free (a GPU), in
    place of this machine's timings: the policy then drafts on most steps, choosing each request's
    rows from its acceptance profile, so the case has the same power on any machine (on this CPU
    the measured costs made it decode target-only on most steps: 58 to 1,080 cycles per run)."""
    costs.observe_target_step = lambda rows, seconds: costs.target_forward.observe(rows, 4e-3 + 1e-5 * rows)
    costs.observe_speculative = lambda drafted, rows, forward, overhead: (
        costs.verify_forward.observe(rows, 4.2e-3 + 1e-5 * rows), costs.draft_overhead.observe(drafted, 1e-3))


def run_case(case: Case) -> Run:
    target, drafter = distilled_pair()
    engine = Engine(target, drafter, None, EngineConfig(
        device="cpu", dtype="float32", max_concurrency=16, verify_threshold=case.verify_threshold,
        retrieval="exact", adaptive_speculation=case.adaptive))
    if case.adaptive:
        _cost_like_a_gpu(engine.scheduler.policy.costs)
    cycles: list[tuple[int, int]] = []
    engine.add_step_observer(
        lambda record: cycles.extend((record.num_verified[r], record.accepted_len[r]) for r in record.accepted_len))
    prompts = [p for p in _prompts(target.args.vocab_size) for _ in range(SEEDS_PER_PROMPT)]
    params = [SamplingParams(**{**case.params.__dict__, "seed": seed, "max_new_tokens": NEW_TOKENS,
                                "ignore_eos": True}) for seed in range(len(prompts))]
    results = engine.generate_many(prompts, params, speculative=True)
    samples: dict[tuple[int, ...], list[list[int]]] = collections.defaultdict(list)
    for prompt, result in zip(prompts, results):
        samples[tuple(prompt)].append(result.token_ids)
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}
    # position 0 comes from prefill (target only); every later one from a speculative cycle
    return Run(fit(target, samples, case.params, first_position=1), cycles)


@pytest.fixture(scope="module")
def real_runs() -> dict[str, Run]:
    return {}


def _real(real_runs, name: str) -> Run:
    if name not in real_runs:
        real_runs[name] = run_case(CASES[name])
    return real_runs[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_engine_samples_follow_the_target(real_runs, name):
    run = _real(real_runs, name)
    assert run.fit.num_tokens >= 0.99 * 4 * SEEDS_PER_PROMPT * (NEW_TOKENS - 1)  # near ties left out: < 1%
    assert run.fit.pvalue > PASS_PVALUE, run.fit

    # the case exercises what it is named for
    accepted = collections.Counter(a for _, a in run.cycles)
    # the policy drafts only where it pays (with the modelled costs of _cost_like_a_gpu)
    scale = 4 if CASES[name].adaptive else 1
    # Gumbel mode accepts about 2.9 rows per cycle (the drafter proposes with the target's noise): fewer cycles
    assert len(run.cycles) > (3_000 if CASES[name].params.reproducible else 6_000) // scale
    assert sum(a for _, a in run.cycles) / len(run.cycles) > CASES[name].min_mean_accepted  # substantial acceptance
    assert set(range(16)) <= set(accepted) or name != "whole-block", sorted(accepted)
    assert sum(1 for v, a in run.cycles if 0 < a < v) > 500 // scale  # rejections mid-block
    truncated_bonus = sum(1 for v, a in run.cycles if 0 < a == v < 15)
    if CASES[name].verify_threshold >= 0.5:
        assert truncated_bonus > 1_000, truncated_bonus  # bonus tokens after a truncated verify
    if CASES[name].verify_threshold == 0.0:
        assert all(v == 15 for v, _ in run.cycles)


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(BROKEN))
def test_the_same_test_fails_a_broken_engine(real_runs, fault):
    assert _real(real_runs, BROKEN[fault]).fit.pvalue > PASS_PVALUE  # the case itself passes
    with faults.inject(fault):
        broken = run_case(CASES[BROKEN[fault]])
    assert broken.fit.pvalue < FAIL_PVALUE, (fault, broken.fit)


def test_every_fault_has_a_case():
    # (faults.MEMORY_FAULTS break no sampled distribution; each names the test that catches it)
    assert set(BROKEN) == set(faults.FAULTS)
    assert set(BROKEN.values()) <= set(CASES)
