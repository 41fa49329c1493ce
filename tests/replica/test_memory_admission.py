"""Admission by memory: a request starts only when its reservation fits every pool; otherwise it
waits (first come first served) or is refused with RESOURCE_EXHAUSTED naming the pool; one larger
than a pool is refused at add time; a draft pool that runs out never fails an admitted request."""

from __future__ import annotations

import grpc
import pytest
import torch

from dspine import faults
from dspine.cluster.errors import status_for
from dspine.replica import SamplingParams
from dspine.replica.admission import DraftPoolCapacity, KvCapacity, PagedKvCapacity, TargetTokenCapacity
from dspine.replica.errors import PoolExhaustedError, RequestTooLargeError
from dspine.replica.reference import reference_generate

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


def _prompts(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _run_two(engine, prompts):
    """Add both, step to the end; returns (outputs, step of each one's first token, waiting seen)."""
    ids = [engine.add_request(p, PARAMS, speculative=True) for p in prompts]
    waiting = engine.load().waiting_for_memory
    outputs, first_step, step = {i: [] for i in ids}, {}, 0
    while engine.has_unfinished():
        step += 1
        for event in engine.step():
            rid = event.request.request_id
            if event.release.token_ids and rid not in first_step:
                first_step[rid] = step
            outputs[rid] += event.release.token_ids
    return [outputs[i] for i in ids], [first_step[i] for i in ids], waiting


def test_a_request_that_does_not_fit_waits_until_memory_frees(build, hybrid_target):
    # 60 draft slots; each request reserves 20 + 20 = 40 of them
    # the contiguous K/V layout: the target side unbounded (no target_kv_tokens), so only the draft pool waits
    engine = build.engine(hybrid_target, draft_pool_tokens=61, max_concurrency=4, target_kv_layout="contiguous")
    assert engine.load().free_draft_tokens == 60 and engine.load().free_target_tokens is None
    prompts = _prompts([20, 20])
    outputs, first_step, waiting = _run_two(engine, prompts)
    assert waiting == 1
    assert first_step[1] > first_step[0] + 1  # it started only after the first one finished
    for prompt, output in zip(prompts, outputs):
        assert output == reference_generate(hybrid_target, prompt, PARAMS.max_new_tokens)
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}
    assert engine.admission.reserved_tokens() == {"target K/V": 0, "draft KV pool": 0}
    assert engine.load().free_draft_tokens == 60


def test_admission_check_fails_when_memory_is_ignored(build, hybrid_target):
    engine = build.engine(hybrid_target, draft_pool_tokens=61, max_concurrency=4)
    with faults.inject("scheduler.admission_ignores_memory"):
        _, first_step, _ = _run_two(engine, _prompts([20, 20]))
    assert first_step[1] == first_step[0]  # both started at once: what the test above rules out


def test_refuse_mode_names_the_pool(build, hybrid_target):
    engine = build.engine(hybrid_target, draft_pool_tokens=61, admission_when_full="refuse")
    prompt = _prompts([20])[0]
    engine.add_request(prompt, PARAMS, speculative=True)
    with pytest.raises(PoolExhaustedError, match="draft KV pool is full") as err:
        engine.add_request(prompt, PARAMS, speculative=True)
    assert err.value.pool == "draft KV pool" and err.value.free == 20 and err.value.needed == 40
    assert status_for(err.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    engine.add_request(prompt, PARAMS, speculative=False)  # target-only holds no draft slots
    engine.shutdown(drain=False)


def test_a_request_larger_than_a_pool_is_refused_at_add_time(build, hybrid_target):
    engine = build.engine(hybrid_target, draft_pool_tokens=61, target_kv_tokens=100, target_kv_layout="contiguous")
    long = _prompts([50])[0]  # 50 + 20 = 70 > 60 draft slots
    with pytest.raises(RequestTooLargeError, match="draft KV pool can never hold") as err:
        engine.add_request(long, PARAMS, speculative=True)
    assert status_for(err.value) == (grpc.StatusCode.RESOURCE_EXHAUSTED, str(err.value))
    assert engine.num_unfinished() == 0
    with pytest.raises(RequestTooLargeError, match="target K/V can never hold"):
        engine.add_request(_prompts([90])[0], PARAMS, speculative=False)  # 110 > 100 target positions
    engine.add_request(long, PARAMS, speculative=False)
    assert engine.load().free_target_tokens == 30
    engine.shutdown(drain=False)


def test_the_paged_pool_is_the_target_side_of_admission(build, hybrid_target):
    """With the paged K/V layout (the default) admission reserves whole blocks of the pool itself,
    verify rows included: target_kv_tokens=100 sizes it to 7 blocks of 16 (+ the sink)."""
    engine = build.engine(hybrid_target, target_kv_tokens=100)
    pool = engine.runner.target_kv_pool
    assert (pool.num_blocks, pool.block_size) == (8, 16) and engine.load().free_target_tokens == 112
    with pytest.raises(RequestTooLargeError, match="target K/V can never hold"):
        engine.add_request(_prompts([80])[0], PARAMS, speculative=True)  # 80 + 20 + 15 rows -> 128 > 112
    engine.add_request(_prompts([50])[0], PARAMS, speculative=True)  # 50 + 20 + 15 -> 6 blocks
    assert engine.load().free_target_tokens == 112 - 96
    while engine.has_unfinished():
        engine.step()
    assert engine.load().free_target_tokens == 112 and pool.num_free_blocks == 7


def test_blocks_of_a_request_cancelled_between_steps_are_back_before_the_next_prefill(build, hybrid_target):
    """Cancel gives a request's reservation back at once and its device state at the next step
    boundary; with the loop running, that boundary must come before the next step's prefill, or a
    request admitted into the reservation finds the pool's blocks still held (7 blocks: the
    cancelled request holds 4, the next one needs 4 for its prompt)."""
    import threading

    engine = build.engine(hybrid_target, target_kv_tokens=100)
    pool = engine.runner.target_kv_pool
    first, second = _prompts([50, 60])
    one_step, unlimited = threading.Semaphore(1), threading.Event()
    real_step = engine.step

    def gated_step():  # the loop's first step runs; the next waits here until the test says so
        if not unlimited.is_set():
            assert one_step.acquire(timeout=30), "the test never released the loop"
        return real_step()

    engine.step = gated_step
    first_chunks, second_chunks, first_token, done = [], [], threading.Event(), threading.Event()

    def first_sink(chunk):
        first_chunks.append(chunk)
        first_token.set()

    def second_sink(chunk):
        second_chunks.append(chunk)
        if chunk.finished:
            done.set()

    engine.start()
    try:
        cancelled = engine.add_request(first, PARAMS, speculative=True, sink=first_sink)
        assert first_token.wait(30)  # its prefill ran and holds ceil(50 / 16) = 4 blocks; the loop now waits
        assert pool.num_free_blocks == 3
        assert engine.cancel(cancelled)
        engine.add_request(second, PARAMS, speculative=True, sink=second_sink)  # 60 + 20 + 15 -> 6 blocks
        unlimited.set()
        one_step.release()
        assert done.wait(60)
    finally:
        unlimited.set()
        one_step.release()
        engine.shutdown(drain=False, timeout=30)
    assert second_chunks[-1].finish_reason == "length", second_chunks[-1]
    assert [t for c in second_chunks for t in c.token_ids] == reference_generate(hybrid_target, second, 20)
    assert engine.stats.num_failed == 0 and pool.num_free_blocks == 7


@pytest.mark.parametrize("pool", ["dense", "ring"])
def test_draft_pool_running_out_never_fails_an_admitted_request(build, hybrid_target, pool):
    # "prompt" reservations: 10 + 16 positions each, so 3 fit in 80 slots, but each decodes 40
    # tokens: the pool runs out and the requests it cannot extend decode on, target-only.
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    engine = build.engine(hybrid_target, window=64, draft_pool=pool, draft_pool_tokens=81,
                          admission_reservation="prompt")
    prompts = _prompts([10, 10, 10])
    results = engine.generate_many(prompts, params, speculative=True)
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length", result.error
        assert result.token_ids == reference_generate(hybrid_target, prompt, params.max_new_tokens)
    assert engine.stats.num_failed == 0
    assert engine.stats.num_draft_demoted >= 1  # it did run out
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}
    with faults.inject("runner.no_draft_pool_fallback"):
        failed = engine.generate_many(prompts, params, speculative=True)
    assert any(r.finish_reason == "error" for r in failed)  # the bug the fallback prevents


def test_capacity_adapters_speak_the_interface():
    class Paged:  # the paged target pool's interface (replica/models/paged_kv_pool.py)
        num_blocks, block_size, num_free_blocks = 10, 16, 4

        def blocks_needed(self, n):
            return -(-n // 16)

    paged = PagedKvCapacity(Paged())
    assert isinstance(paged, KvCapacity) and isinstance(TargetTokenCapacity(None), KvCapacity)
    # block 0 is the pool's padding sink: 9 blocks hold requests
    assert (paged.capacity_tokens(), paged.tokens_for(17), paged.free_tokens()) == (144, 32, 64)
    assert PagedKvCapacity(Paged(), verify_rows=15).tokens_for(18) == 48  # 18 + 15 rows -> 3 blocks

    class Ring:
        capacity, num_free, window = 100, 40, 8

    ring = DraftPoolCapacity(Ring())
    assert (ring.tokens_for(50), ring.tokens_for(5), ring.free_tokens()) == (8, 5, 40)


def test_cluster_engine_settings_carry_the_memory_knobs():
    from pydantic import ValidationError

    from dspine.cluster.config import EngineSettings

    config = EngineSettings(device_memory="141GB", target_kv_tokens=1000, admission_when_full="refuse",
                            admission_reservation="prompt", prefill_chunk_tokens=512).engine_config(1)
    assert (config.device_memory, config.target_kv_tokens, config.admission_when_full,
            config.admission_reservation, config.prefill_chunk_tokens) == (141 * 10**9, 1000, "refuse", "prompt", 512)
    with pytest.raises(ValidationError, match="device_memory"):
        EngineSettings(device_memory="lots")
