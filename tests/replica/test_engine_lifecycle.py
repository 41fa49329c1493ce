"""Admission cap, cancellation, failure isolation, streaming and leak checks of the engine."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from dspine.replica import EngineFullError, InvalidRequestError, NoDrafterError, SamplingParams
from dspine.replica.reference import reference_generate

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
IDLE = {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_ninth_concurrent_request_is_refused_at_once(build, hybrid_target):
    engine = build.engine(hybrid_target)
    ids = [engine.add_request(_prompt(512, 4, i), PARAMS) for i in range(8)]
    with pytest.raises(EngineFullError, match="max_concurrency=8"):
        engine.add_request(_prompt(512, 4, 99), PARAMS)
    engine.step()  # running requests do not change the count
    with pytest.raises(EngineFullError):
        engine.add_request(_prompt(512, 4, 99), PARAMS)
    assert engine.cancel(ids[3])
    engine.add_request(_prompt(512, 4, 99), PARAMS)  # the cancelled slot is free again
    while engine.has_unfinished():
        engine.step()
    assert engine.num_live_states() == IDLE


def test_max_concurrency_is_configurable(build, hybrid_target):
    engine = build.engine(hybrid_target, max_concurrency=2)
    engine.add_request([1, 2], PARAMS)
    engine.add_request([3, 4], PARAMS)
    with pytest.raises(EngineFullError, match="max_concurrency=2"):
        engine.add_request([5, 6], PARAMS)


@pytest.mark.parametrize("prompt, field", [
    ([], "prompt_token_ids"),
    ([1, 512], "prompt_token_ids"),
    ([1, -1], "prompt_token_ids"),
    ([1, 2.0], "prompt_token_ids"),
    ("12", "prompt_token_ids"),
], ids=["empty", "out-of-vocab", "negative", "float", "string"])
def test_bad_prompts_name_the_field(build, hybrid_target, prompt, field):
    engine = build.engine(hybrid_target)
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(prompt, PARAMS)
    assert error.value.field == field
    assert engine.num_live_states() == IDLE


def test_prompt_at_context_limit_is_refused(build, hybrid_target):
    engine = build.engine(hybrid_target, max_seq_len=16)
    with pytest.raises(InvalidRequestError, match="context limit is 16"):
        engine.add_request(list(range(16)), PARAMS)


def test_speculation_without_drafter_is_a_clear_error(build, hybrid_target):
    engine = build.engine(hybrid_target, with_drafter=False)
    with pytest.raises(NoDrafterError, match="no drafter loaded"):
        engine.add_request([1, 2, 3], PARAMS, speculative=True)
    assert engine.generate([1, 2, 3], PARAMS).token_ids == reference_generate(hybrid_target, [1, 2, 3], 12)


def test_random_cancels_and_injected_failures_leave_nothing_behind(build, hybrid_target):
    engine = build.engine(hybrid_target, window=6)
    rng = random.Random(0)
    prompts = {f"r{i}": _prompt(512, rng.randint(1, 20), i) for i in range(24)}
    doomed = {f"r{i}": rng.choice(["prefill", "draft", "tail", "verify", "commit", "target_step"])
              for i in range(0, 24, 5)}
    cancel_after = {f"r{i}": rng.randint(0, 4) for i in range(2, 24, 4)}

    def fault_hook(stage, request_ids):
        for request_id in request_ids:
            if doomed.get(request_id) == stage:
                raise RuntimeError(f"injected failure in {stage}")

    engine.runner.fault_hook = fault_hook
    outputs, finish = {}, {}
    pending = list(prompts)
    steps = {}
    while pending or engine.has_unfinished():
        while pending and engine.scheduler.num_unfinished < 8:
            request_id = pending.pop(0)
            speculative = doomed.get(request_id) != "target_step" and rng.random() < 0.7
            engine.add_request(prompts[request_id], PARAMS, speculative=speculative, request_id=request_id)
            outputs[request_id], steps[request_id] = [], 0
        for event in engine.step():
            request_id = event.request.request_id
            outputs[request_id] += event.release.token_ids
            if event.release.status is not None:
                finish[request_id] = event.release.status.finish_reason
        for request_id in list(steps):
            if request_id in finish:
                continue
            steps[request_id] += 1
            if cancel_after.get(request_id) == steps[request_id]:
                engine.cancel(request_id)
                finish[request_id] = "cancelled"
    assert engine.num_live_states() == IDLE
    assert engine.runner.draft_pool.used == 0
    for request_id, prompt in prompts.items():
        if finish[request_id] == "length":
            # the survivors are untouched by their neighbours' failures and cancels
            assert outputs[request_id] == reference_generate(hybrid_target, prompt, PARAMS.max_new_tokens)
    failed = {r for r, f in finish.items() if f == "error"}
    assert failed and failed <= set(doomed)
    assert engine.stats.num_failed == len(failed)


def test_stream_yields_the_same_tokens_as_generate(build, hybrid_target):
    engine = build.engine(hybrid_target)
    prompt = _prompt(512, 7, 3)
    chunks = list(engine.stream(prompt, PARAMS, speculative=True))
    assert [t for c in chunks for t in c.token_ids] == engine.generate(prompt, PARAMS, speculative=True).token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert len(chunks) >= 2  # streamed cycle by cycle, not in one piece


def test_async_stream_and_early_close_frees_the_slot(build, hybrid_target):
    engine = build.engine(hybrid_target)
    prompt = _prompt(512, 9, 4)
    expected = reference_generate(hybrid_target, prompt, PARAMS.max_new_tokens)
    long_params = SamplingParams(temperature=0.0, max_new_tokens=500, ignore_eos=True)

    async def main():
        tokens = [t async for c in engine.generate_stream(prompt, PARAMS, speculative=True) for t in c.token_ids]
        stream = engine.generate_stream(prompt, long_params, speculative=True)
        first = await stream.__anext__()
        await stream.aclose()  # the caller goes away mid-generation
        return tokens, first

    try:
        tokens, first = asyncio.run(main())
    finally:
        engine.shutdown(drain=False, timeout=10)
    assert tokens == expected
    assert first.token_ids and first.finish_reason is None
    assert engine.num_live_states() == IDLE


def test_shutdown_drains_in_flight_requests(build, hybrid_target):
    engine = build.engine(hybrid_target)
    engine.start()
    stream = engine.stream(_prompt(512, 5, 5), PARAMS, speculative=True)
    first = next(stream)
    engine.shutdown(drain=True, timeout=30)
    rest = list(stream)
    assert (rest[-1] if rest else first).finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == PARAMS.max_new_tokens
    assert engine.num_live_states() == IDLE


def test_generate_many_while_the_background_loop_steps(build, hybrid_target):
    engine = build.engine(hybrid_target)
    engine.start()
    try:
        prompts = [_prompt(512, n, n) for n in (3, 8, 5)]
        results = engine.generate_many(prompts, PARAMS, speculative=True)
    finally:
        engine.shutdown(timeout=30)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_generate(hybrid_target, prompt, PARAMS.max_new_tokens)


@pytest.mark.parametrize("draft_pool", ["dense", "ring"])
def test_default_draft_pool_holds_every_request_at_its_largest(build, hybrid_target, draft_pool):
    """8 ring requests at a full window (or 8 dense ones at max_seq_len) fit the default pool:
    sizing it without the padding sink left one slot short, and the eighth request failed."""
    engine = build.engine(hybrid_target, window=6, draft_pool=draft_pool, max_seq_len=40)
    per_request = 6 if draft_pool == "ring" else 40
    assert engine.runner.draft_pool.capacity >= 8 * per_request
    prompts = [_prompt(512, 12, seed) for seed in range(8)]
    params = SamplingParams(temperature=0.0, max_new_tokens=40 - 12, ignore_eos=True)
    results = engine.generate_many(prompts, params, speculative=True)  # all 8 in flight, windows full
    assert [r.finish_reason for r in results] == ["length"] * 8
    assert engine.stats.peak_draft_pool_used >= 8 * 6
    assert engine.num_live_states() == IDLE


def test_generate_many_keeps_at_most_max_in_flight_and_refills_their_slots(build, hybrid_target):
    """Six prompts with at most 2 in flight: no step carries more than 2, every step but the last ones
    carries 2 (a finished request's slot goes to the next prompt), and the outputs are the reference's."""
    engine = build.engine(hybrid_target)
    batches: list[int] = []
    engine.add_step_observer(lambda record: batches.append(len(record.request_ids)))
    prompts = [_prompt(512, 4, seed) for seed in range(6)]
    lengths = [3, 9, 5, 7, 4, 6]  # uneven: requests finish at different steps
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    results = engine.generate_many(prompts, params, speculative=False, max_in_flight=2)
    for prompt, n, result in zip(prompts, lengths, results):
        assert result.token_ids == reference_generate(hybrid_target, prompt, n)
    assert max(batches) == 2
    # steps run 2 requests until the prompts run out, then the last request alone for at most its length
    assert batches == sorted(batches, reverse=True) and batches.count(1) <= max(lengths), batches
    with pytest.raises(InvalidRequestError, match="max_in_flight"):
        engine.generate_many(prompts[:1], params[0], max_in_flight=0)
    assert engine.num_live_states() == IDLE
