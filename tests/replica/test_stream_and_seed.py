"""Closing a stream early cancels its request and frees every slot; a seeded sampled request gives
the same tokens alone and inside a batch of different requests.

The stream tests check the engine's state right after the close, before any shutdown (which would
cancel everything itself) and while a long request would otherwise keep running, so they fail when
the close path stops cancelling. The seed tests fail when the seed is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import torch

from dspine.replica import EngineFullError, SamplingParams
from dspine.replica.reference import reference_generate

IDLE = {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}
# Long enough that a request nobody cancels is still running when the test looks.
LONG = SamplingParams(temperature=0.0, max_new_tokens=2000, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_idle_and_reusable(engine, target, prompt) -> None:
    assert engine.num_live_states() == IDLE
    assert engine.load().in_flight == 0 and engine.load().live_target_states == 0
    if engine.runner.draft_pool is not None:
        assert engine.load().free_draft_slots == engine.load().draft_slots
    assert engine.stats.num_cancelled == 1
    # all max_concurrency slots are free again, and the engine still decodes correctly
    ids = [engine.add_request(_prompt(512, 3, i), SHORT) for i in range(engine.config.max_concurrency)]
    with pytest.raises(EngineFullError):
        engine.add_request([1, 2], SHORT)
    for request_id in ids:
        engine.cancel(request_id)
    assert engine.generate(prompt, SHORT, speculative=True).token_ids == reference_generate(target, prompt, 10)


# ------------------------------------------------------------- sync stream
def _close(stream):
    next(stream)
    stream.close()


def _break(stream):
    for _ in stream:
        break
    # the for loop held the only reference: CPython closes the generator as the loop exits


def _raise(stream):
    with pytest.raises(KeyError):
        for _ in stream:
            raise KeyError("the consumer failed")


def _closing(stream):
    with contextlib.closing(stream) as chunks:
        for _ in chunks:
            break


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
@pytest.mark.parametrize("leave", [_close, _break, _raise, _closing], ids=["close", "break", "raise", "closing"])
def test_leaving_the_sync_stream_early_cancels_and_frees_everything(build, hybrid_target, leave, speculative):
    engine = build.engine(hybrid_target)
    prompt = _prompt(512, 9, 1)
    stream = engine.stream(prompt, LONG, speculative=speculative)
    first = next(stream)
    assert first.token_ids and first.finish_reason is None
    live = engine.num_live_states()
    assert (live["requests"], live["target_states"]) == (1, 1)
    assert (live["draft_slots"] > 0) == speculative  # draft KV positions held for the request
    assert engine.load().in_flight == 1

    leave(stream)
    del stream
    _assert_idle_and_reusable(engine, hybrid_target, prompt)


def test_closing_the_sync_stream_while_the_background_loop_steps(build, hybrid_target):
    engine = build.engine(hybrid_target)
    engine.start()
    try:
        prompt = _prompt(512, 6, 2)
        stream = engine.stream(prompt, LONG, speculative=True)
        chunks = [next(stream), next(stream)]
        assert all(c.finish_reason is None for c in chunks)
        stream.close()
        # checked at once: the loop would otherwise still be decoding LONG's 2000 tokens
        assert engine.num_live_states() == IDLE
        assert engine.stats.num_cancelled == 1 and engine.load().in_flight == 0
        tokens = [t for c in engine.stream(prompt, SHORT, speculative=True) for t in c.token_ids]
        assert tokens == reference_generate(hybrid_target, prompt, 10)
    finally:
        engine.shutdown(drain=False, timeout=10)


# ------------------------------------------------------------ async stream
def test_async_stream_close_frees_the_slot_before_any_shutdown(build, hybrid_target):
    """test_engine_lifecycle's early-close test looks after ``shutdown(drain=False)``, which cancels
    everything itself; this one looks right after the consumer leaves, with the loop still running."""
    engine = build.engine(hybrid_target)
    prompt = _prompt(512, 7, 3)

    async def checks():
        # 1. aclose() mid-generation
        stream = engine.generate_stream(prompt, LONG, speculative=True)
        for _ in range(2):
            assert (await stream.__anext__()).finish_reason is None
        running = engine.num_live_states()
        assert (running["requests"], running["target_states"]) == (1, 1) and running["draft_slots"] > 0
        await stream.aclose()
        assert (engine.num_live_states(), engine.stats.num_cancelled) == (IDLE, 1)

        # 2. break out of `async with aclosing(...)`
        async with contextlib.aclosing(engine.generate_stream(prompt, LONG, speculative=False)) as chunks:
            async for _ in chunks:
                break
        assert (engine.num_live_states(), engine.stats.num_cancelled) == (IDLE, 2)

        # 3. the consuming task is cancelled (what a server does when its client goes away)
        started = asyncio.Event()

        async def consumer():
            async for _ in engine.generate_stream(prompt, LONG, speculative=True):
                started.set()

        task = asyncio.create_task(consumer())
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert (engine.num_live_states(), engine.stats.num_cancelled) == (IDLE, 3)

        # the loop kept serving: the next request is exact
        tokens = [t async for c in engine.generate_stream(prompt, SHORT, speculative=True) for t in c.token_ids]
        assert tokens == reference_generate(hybrid_target, prompt, 10)
        assert not engine._loop.done()

    async def main():
        try:
            await checks()
        finally:  # while this event loop still runs: a leaked request's sink posts to it
            engine.shutdown(drain=False, timeout=10)

    asyncio.run(main())


# ------------------------------------------------------------------- seeds
SAMPLED = {
    "top-k-0": SamplingParams(temperature=0.8, top_k=0, seed=1234, max_new_tokens=24, ignore_eos=True),
    "top-p-0.9": SamplingParams(temperature=0.8, top_k=0, top_p=0.9, seed=1234, max_new_tokens=24, ignore_eos=True),
}


def _neighbours(subject: SamplingParams) -> list[SamplingParams]:
    """Seven other requests: other seeds, no seed, greedy, top-k, the subject's own seed, and
    lengths that make them finish at different steps (the batch changes under the subject)."""
    sampled = dict(temperature=0.8, ignore_eos=True)
    return [
        SamplingParams(seed=7, max_new_tokens=5, **sampled),
        SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True),
        SamplingParams(seed=None, top_p=0.5, max_new_tokens=12, **sampled),
        SamplingParams(temperature=1.3, top_k=20, seed=99, max_new_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True),
        SamplingParams(seed=subject.seed, max_new_tokens=17, **sampled),  # same seed, other prompt
        SamplingParams(seed=2**63 + 5, top_k=50, max_new_tokens=24, **sampled),
    ]


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
@pytest.mark.parametrize("name", list(SAMPLED))
def test_same_seed_same_tokens_alone_and_in_a_batch_of_eight(build, hybrid_target, name, speculative):
    subject = SAMPLED[name]
    engine = build.engine(hybrid_target)
    prompt = _prompt(512, 11, 5)
    alone = engine.generate(prompt, subject, speculative=speculative).token_ids
    assert len(alone) == subject.max_new_tokens

    others = [_prompt(512, n, 100 + n) for n in (3, 17, 6, 9, 2, 13, 8)]
    prompts = others[:3] + [prompt] + others[3:]
    params = _neighbours(subject)
    params = params[:3] + [subject] + params[3:]
    batch = engine.generate_many(prompts, params, speculative=speculative)
    assert len(batch) == 8 and engine.stats.peak_in_flight == 8  # all eight shared the steps
    assert batch[3].token_ids == alone
    assert batch[6].token_ids != alone[:17]  # the same seed on another prompt is another sequence

    # a fresh engine, the subject first in a batch this time: still the same tokens
    again = build.engine(hybrid_target).generate_many([prompt] + others[:4], [subject] + params[:4],
                                                      speculative=speculative)
    assert again[0].token_ids == alone

    # the seed decides: another seed gives other tokens (so the checks above can fail)
    other_seed = dataclasses.replace(subject, seed=subject.seed + 1)
    assert engine.generate(prompt, other_seed, speculative=speculative).token_ids != alone
    assert engine.num_live_states() == IDLE
