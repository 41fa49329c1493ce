"""The shipped sampled drafter (embedded/draft-sampled) beside the greedy one: it serves the sampled
requests of the embedded pair (their stats name it), the emitted tokens still follow the target's own
distribution (the same fit as tests/replica/test_sampling_lossless.py, on the real 4,096-token target),
and greedy requests keep the greedy drafter and target-only's tokens."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from dspine_testing.lossless import fit

from dspine import embedded, faults
from dspine.benchmarks.prompts import heldout_prompts
from dspine.replica import Engine, EngineConfig, SamplingParams

SEEDS_PER_PROMPT = 96
NEW_TOKENS = 16
PARAMS = SamplingParams(temperature=0.7)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    assert embedded.sampled_available(), "the sampled drafter must ship as package data (embedded/draft-sampled)"
    return Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR,
                                  EngineConfig(device="cpu", dtype="float32", retrieval="exact",
                                               adaptive_speculation=False),
                                  sampled_draft_dir=embedded.SAMPLED_DRAFT_DIR)


def _sampled_run(engine, prompts):
    params = [SamplingParams(**{**PARAMS.__dict__, "seed": seed, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
              for seed in range(len(prompts))]
    results = engine.generate_many(prompts, params, speculative=True)
    samples = collections.defaultdict(list)
    for prompt, result in zip(prompts, results):
        samples[tuple(prompt)].append(result.token_ids)
    return results, fit(engine.target, samples, PARAMS, first_position=1)


def test_the_sampled_drafter_ships_with_the_greedy_drafters_geometry():
    from dspine.replica.drafters import PER_DRAFTER_FIELDS
    from dspine.training.draft import SAMPLED_RECIPE

    greedy = json.loads((embedded.DRAFT_DIR / "config.json").read_text())
    sampled = json.loads((embedded.SAMPLED_DRAFT_DIR / "config.json").read_text())
    assert {k: v for k, v in greedy.items() if k not in PER_DRAFTER_FIELDS} == {
        k: v for k, v in sampled.items() if k not in PER_DRAFTER_FIELDS}
    # its own tail: the recipe's candidates per row (32), the greedy drafter's 16
    assert sampled["head_topk"] == dict(SAMPLED_RECIPE["model_overrides"])["head_topk"] == 32
    assert greedy["head_topk"] == 16
    summary = json.loads((embedded.SAMPLED_DRAFT_DIR / "train_summary.json").read_text())
    recipe = summary["config"]
    assert recipe["continuation_temperature"] > 0 and recipe["soft_label_topk"] > 0
    assert summary["num_sequences"] >= 16_384  # the 16k scale


@pytest.mark.slow
def test_sampled_requests_draft_with_it_and_follow_the_target(engine):
    prompts = [p for p in heldout_prompts(engine, num_prompts=3, prompt_len=48) for _ in range(SEEDS_PER_PROMPT)]
    results, result_fit = _sampled_run(engine, prompts)
    assert {r.stats.drafter for r in results} == {"sampled"}
    assert result_fit.num_tokens >= 0.99 * len(prompts) * (NEW_TOKENS - 1)
    assert result_fit.pvalue > 1e-4, result_fit
    cycles = sum(r.stats.spec.num_cycles for r in results)
    accepted = sum(r.stats.spec.num_accepted_tokens for r in results)
    assert accepted / cycles > 0.8  # the greedy drafter accepts about 0.5 on these prompts
    # the same fit fails an engine whose target p ignores the temperature
    with faults.inject("runner.p_without_temperature"):
        _, broken = _sampled_run(engine, prompts)
    assert broken.pvalue < 1e-6, broken


def test_greedy_requests_keep_the_greedy_drafter_and_target_only_tokens(engine):
    prompts = heldout_prompts(engine, num_prompts=4, prompt_len=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    target_only = engine.generate_many(prompts, params, speculative=False)
    speculative = engine.generate_many(prompts, params, speculative=True)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in target_only]
    assert {r.stats.drafter for r in speculative} == {"greedy"}
