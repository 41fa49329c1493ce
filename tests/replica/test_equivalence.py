"""Greedy losslessness: speculative output equals target-only greedy output, token for token."""

from __future__ import annotations

import functools

import pytest
import torch
from dspine_testing.distill import distilled_pair

from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.reference import reference_generate
from dspine.replica.tail import Proposal


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("verify_threshold", [0.0, 0.05], ids=["whole-block", "dynamic"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"], ids=["hybrid-gdn", "dense-qwen3"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_speculative_greedy_equals_reference(build, preset, batch, verify_threshold):
    target = build.target(preset)
    # 24 new tokens run past the 6-position draft window
    engine = build.engine(target, window=6, verify_threshold=verify_threshold)
    prompts = _prompts(target.args.vocab_size, [3, 17, 5, 29, 1, 11, 8, 23][:batch])
    results = engine.generate_many(prompts, GREEDY, speculative=True)
    for prompt, result in zip(prompts, results):
        expected = reference_generate(target, prompt, GREEDY.max_new_tokens)
        assert result.token_ids == expected
        assert result.finish_reason == "length"
        assert result.stats.spec.num_cycles >= 1
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}


def test_target_only_greedy_equals_reference(build, hybrid_target):
    engine = build.engine(hybrid_target, with_drafter=False)
    prompts = _prompts(hybrid_target.args.vocab_size, [4, 19, 7])
    for prompt, result in zip(prompts, engine.generate_many(prompts, GREEDY, speculative=False)):
        assert result.token_ids == reference_generate(hybrid_target, prompt, GREEDY.max_new_tokens)


def test_mixed_speculative_and_target_only_in_one_batch(build, hybrid_target):
    engine = build.engine(hybrid_target)
    prompts = _prompts(hybrid_target.args.vocab_size, [6, 13, 2, 9])
    ids = [engine.add_request(p, GREEDY, speculative=bool(i % 2)) for i, p in enumerate(prompts)]
    outputs = {i: [] for i in ids}
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.request.request_id] += event.release.token_ids
    for request_id, prompt in zip(ids, prompts):
        assert outputs[request_id] == reference_generate(hybrid_target, prompt, GREEDY.max_new_tokens)


def _oracle(engine, target, always_right: bool, confidence_seed: int | None = None):
    """Replace the tail with proposals built from the reference continuation (with random
    confidences when confidence_seed is given, so dynamic verification picks ragged lengths)."""
    vocab = target.args.vocab_size
    num_draft = engine.block_size - 1
    cache: dict[str, list[int]] = {}

    def propose(request_ids, requests, draft_out, anchors, params, generators):
        rows = []
        for request_id in request_ids:
            request = requests[request_id]
            if request_id not in cache:
                cache[request_id] = reference_generate(target, request.prompt_token_ids, 80)
            done = len(request.output_token_ids)
            truth = (cache[request_id][done : done + num_draft] + [0] * num_draft)[:num_draft]
            rows.append(truth if always_right else [(t + 1) % vocab for t in truth])
        draft_ids = torch.tensor(rows, dtype=torch.long)
        cand_ids = draft_ids[..., None].repeat(1, 1, engine.drafter.args.head_topk)
        q = torch.zeros(cand_ids.shape, dtype=torch.float64)
        q[..., 0] = 1.0
        confidence = None
        if confidence_seed is not None:
            confidence = torch.rand(draft_ids.shape, generator=confidence_generator) * 0.5 + 0.5
        return Proposal(draft_ids=draft_ids, q=q, cand_ids=cand_ids, choice=torch.zeros_like(draft_ids),
                        confidence=confidence)

    confidence_generator = torch.Generator().manual_seed(confidence_seed or 0)
    engine.runner.propose = propose


@pytest.mark.parametrize("always_right", [False, True], ids=["accept-0", "accept-15"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"], ids=["hybrid-gdn", "dense-qwen3"])
def test_forced_acceptance_patterns(build, preset, always_right):
    target = build.target(preset)
    engine = build.engine(target, window=8)
    _oracle(engine, target, always_right)
    prompts = _prompts(target.args.vocab_size, [5, 12, 3])
    params = SamplingParams(temperature=0.0, max_new_tokens=61, ignore_eos=True)
    results = engine.generate_many(prompts, params, speculative=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_generate(target, prompt, params.max_new_tokens)
        histogram = result.stats.spec.accepted_len_histogram
        if always_right:
            # 1 token from prefill, then 16 per cycle: 60 = 15 + 16 + 16 + 13 (the last cycle is cut by length)
            assert histogram[15] == result.stats.spec.num_cycles
        else:
            assert histogram[0] == result.stats.spec.num_cycles == params.max_new_tokens - 1


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"], ids=["hybrid-gdn", "dense-qwen3"])
def test_dynamic_verification_with_ragged_lengths(build, preset):
    """Every draft token right, random confidences: each request verifies its own prefix length
    (different lengths in one batch), accepts all of it and emits the bonus after it."""
    target = build.target(preset)
    engine = build.engine(target, window=8, verify_threshold=0.2)
    _oracle(engine, target, always_right=True, confidence_seed=3)
    prompts = _prompts(target.args.vocab_size, [5, 12, 3, 9])
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    results = engine.generate_many(prompts, params, speculative=True)
    verified_lengths = set()
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_generate(target, prompt, params.max_new_tokens)
        spec = result.stats.spec
        # all verified tokens accepted: accepted == verified in every cycle
        assert spec.num_accepted_tokens == spec.num_draft_tokens
        verified_lengths |= {n for n, count in enumerate(spec.accepted_len_histogram) if count}
    assert len(verified_lengths) >= 3  # the threshold really cut blocks at different lengths
    assert max(verified_lengths) < 15
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}


# ------------------------------------------------- a drafter with real, partial acceptance
# The random drafter above accepts 0 tokens in nearly every cycle. The pair below (a predictable
# tiny target and a drafter distilled toward it in seconds, dspine_testing.distill) runs the real
# draft path with cycles that end anywhere in the block, so mid-block rejection, the bonus after a
# full block and the commit of every accepted length reach the engine.
NUM_ROWS = 15  # draft rows per block (block size 16)
DISTILLED_GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
# Drafter seeds for which the 256 prompts below end cycles at every row (rows 9-13 are rare: a
# block that gets 9 rows right usually gets all of them right).
DISTILL_SEED = {"tiny": 2, "tiny-qwen3": 1}


def _pair(preset: str):
    return distilled_pair(preset, window=16, seed=DISTILL_SEED[preset])


@functools.lru_cache(maxsize=None)
def _distilled_reference(preset: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    target, _ = _pair(preset)
    return reference_generate(target, list(prompt), max_new_tokens)


# name -> (verify_threshold, adaptive_speculation)
VERIFICATION = {"whole-block": (0.0, False), "dynamic": (0.05, False), "adaptive": (0.05, True)}


def _distilled_run(preset, prompts, verification, draft_pool="dense", retrieval="exact",
                   params=DISTILLED_GREEDY, baseline="reference"):
    """Run ``prompts`` speculatively; returns (per-cycle (verified, accepted), engine) after checking
    every output against target-only greedy decoding (``baseline``: the stateless reference, or the
    engine's own target-only path, which is faster for many prompts) and that nothing leaked."""
    target, drafter = _pair(preset)
    verify_threshold, adaptive = VERIFICATION[verification]
    engine = Engine(target, drafter, None, EngineConfig(
        device="cpu", dtype="float32", draft_pool=draft_pool, retrieval=retrieval,
        verify_threshold=verify_threshold, adaptive_speculation=adaptive))
    cycles: list[tuple[int, int]] = []
    engine.add_step_observer(
        lambda record: cycles.extend((record.num_verified[r], record.accepted_len[r]) for r in record.accepted_len))
    results = engine.generate_many(prompts, params, speculative=True)
    if baseline == "reference":
        expected = [_distilled_reference(preset, tuple(p), params.max_new_tokens) for p in prompts]
    else:
        expected = [r.token_ids for r in engine.generate_many(prompts, params, speculative=False)]
    for result, want in zip(results, expected):
        assert result.token_ids == want
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}
    return cycles, engine


@pytest.mark.parametrize("retrieval", ["exact", "bf16", "fp8"])
@pytest.mark.parametrize("draft_pool", ["dense", "ring"])
@pytest.mark.parametrize("verification", list(VERIFICATION))
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"], ids=["hybrid-gdn", "dense-qwen3"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_distilled_drafter_greedy_equals_reference(preset, batch, verification, draft_pool, retrieval):
    # 32 new tokens after prompts of up to 29 run past the 16-position window of the ring pool
    prompts = _prompts(64, [3, 17, 5, 29, 1, 11, 8, 23][:batch], seed=2)
    cycles, engine = _distilled_run(preset, prompts, verification, draft_pool, retrieval)
    tables = engine.runner.tail_tables
    assert (tables.head_fp8 is not None) == (retrieval == "fp8")
    assert (tables.head_bf16 is not None) == (retrieval == "bf16")
    accepted = {a for _, a in cycles}
    if batch == 8 and verification != "adaptive":  # the policy's cycles depend on this machine's timings
        assert 0 in accepted and accepted - {0, NUM_ROWS}, sorted(accepted)  # rejections, also mid-block
    assert cycles  # every run drafted (adaptive: at least its first step, before any cost is known)
    if verification == "whole-block":
        assert {v for v, _ in cycles} == {NUM_ROWS}


@pytest.mark.parametrize("verification", ["whole-block", "dynamic"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"], ids=["hybrid-gdn", "dense-qwen3"])
def test_cycles_accept_every_length_from_0_to_15(preset, verification):
    """Over 256 prompts at batch 8, every accepted length 0..15 occurs, with identical output."""
    lengths = torch.randint(1, 30, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = _prompts(64, lengths, seed=1)
    cycles, _ = _distilled_run(preset, prompts, verification, baseline="target-only")
    histogram = [sum(1 for _, a in cycles if a == n) for n in range(NUM_ROWS + 1)]
    assert all(histogram), histogram
    if verification == "dynamic":
        assert any(v < NUM_ROWS for v, _ in cycles)  # dynamic verification really cut blocks
