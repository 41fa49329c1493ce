"""Refusals and cancels never wait for a running step (issue 20, item 7).

A test hook holds the engine inside a step (the runner's ``fault_hook`` blocks on an Event), so
nothing here depends on timing: while the step is held, a full engine refuses, a memory refusal
names its pool and a cancel returns with the sink told; after the step is let go the cancelled
request has left nothing behind. Under ``engine.admission_waits_for_step`` (the old locking:
admission takes the lock the step holds while the model runs) the same calls stay blocked until
the step ends, which is what the first test's central assertion catches.
"""

from __future__ import annotations

import threading

import pytest
import torch

from dspine import faults
from dspine.replica import EngineFullError, SamplingParams
from dspine.replica.errors import PoolExhaustedError
from dspine.replica.reference import reference_generate

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
IDLE = {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}
# Long enough for "the step ended" and "the worker finished" never to be confused; a worker that
# returns at all returns in milliseconds.
HOLD_S = 120.0
WORKER_S = 30.0


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class HeldStep:
    """Blocks the engine inside the next ``stage`` of a step until :meth:`let_go`."""

    def __init__(self, engine, stage: str = "prefill"):
        self.inside, self._go = threading.Event(), threading.Event()

        def hook(name, request_ids):
            if name == stage and not self._go.is_set():
                self.inside.set()
                self._go.wait(HOLD_S)

        engine.runner.fault_hook = hook

    def let_go(self) -> None:
        self._go.set()


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _refuse_and_cancel_while_held(engine, cancel_id: str, sink_chunks: list, worker_s: float):
    """With the engine held inside a step: a refused add and a cancel, from another thread.
    Returns (whether they returned while the step was still held, what they did, the stepper)."""
    held = HeldStep(engine)
    stepper, _ = _in_thread(engine.step)
    assert held.inside.wait(HOLD_S), "the step never reached the held stage"

    def refuse_then_cancel():
        try:
            engine.add_request(_prompt(4, 99), PARAMS)
            refused = None
        except EngineFullError as e:
            refused = e
        cancelled = engine.cancel(cancel_id)
        return refused, cancelled, list(sink_chunks)

    worker, outcome = _in_thread(refuse_then_cancel)
    worker.join(worker_s)
    returned_while_held = not worker.is_alive() and stepper.is_alive()
    held.let_go()
    stepper.join(HOLD_S)
    worker.join(HOLD_S)
    assert not stepper.is_alive() and not worker.is_alive()
    return returned_while_held, outcome, stepper


def test_a_full_engine_refuses_and_a_cancel_returns_while_a_step_runs(build, hybrid_target):
    engine = build.engine(hybrid_target, max_concurrency=2)
    chunks_a, chunks_b = [], []
    prompt_b = _prompt(5, 2)
    a = engine.add_request(_prompt(5, 1), PARAMS, speculative=True, sink=chunks_a.append)
    engine.add_request(prompt_b, PARAMS, speculative=False, sink=chunks_b.append)

    returned_while_held, outcome, _ = _refuse_and_cancel_while_held(engine, a, chunks_a, WORKER_S)

    assert returned_while_held
    refused, cancelled, chunks_at_cancel = outcome["value"]
    assert isinstance(refused, EngineFullError) and "max_concurrency=2" in str(refused)
    assert cancelled
    # the sink heard of the cancel at once, before the step it was part of ended
    assert [c.finish_reason for c in chunks_at_cancel] == ["cancelled"]
    assert engine.num_unfinished() == 1 and engine.load().in_flight == 1  # its slot is free already
    while engine.has_unfinished():
        engine.step()
    # nothing reached the cancelled request's sink after its last chunk; the other is untouched
    assert [c.finish_reason for c in chunks_a] == ["cancelled"]
    assert chunks_b[-1].finish_reason == "length"
    assert [t for c in chunks_b for t in c.token_ids] == reference_generate(hybrid_target, prompt_b, 6)
    assert engine.num_live_states() == IDLE
    assert engine.runner.draft_pool.used == 0 and not engine.runner.generators
    assert (engine.stats.num_cancelled, engine.stats.num_finished) == (1, 2)
    assert engine.stats.peak_in_flight == 2


def test_the_old_locking_makes_the_refusal_wait_for_the_step(build, hybrid_target):
    """The bug the test above exists for: with admission behind the step's lock, the refusal and
    the cancel only return once the step is let go."""
    engine = build.engine(hybrid_target, max_concurrency=2)
    chunks_a = []
    a = engine.add_request(_prompt(5, 1), PARAMS, sink=chunks_a.append)
    engine.add_request(_prompt(5, 2), PARAMS)
    with faults.inject("engine.admission_waits_for_step"):
        # blocked for sure while held: a short wait is enough to see it
        returned_while_held, outcome, _ = _refuse_and_cancel_while_held(engine, a, chunks_a, worker_s=1.0)
    assert not returned_while_held
    refused, cancelled, _ = outcome["value"]  # they did go through once the step ended
    assert isinstance(refused, EngineFullError) and cancelled
    while engine.has_unfinished():
        engine.step()
    assert engine.num_live_states() == IDLE


def test_memory_refusal_and_cancel_go_through_while_the_loop_is_inside_a_step(build, hybrid_target):
    """Server mode: the background loop steps; a refusal by memory (admission_when_full='refuse')
    names its pool while the loop is held inside a speculative cycle, and a cancelled stream ends
    at once with its slot, reservation and (after the step) its device state given back."""
    engine = build.engine(hybrid_target, draft_pool_tokens=61, admission_when_full="refuse")
    prompt = _prompt(20, 3)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    chunks = []
    held = HeldStep(engine, stage="verify")
    engine.start()
    try:
        running = engine.add_request(prompt, params, speculative=True, sink=chunks.append)
        assert held.inside.wait(HOLD_S)
        reserved = engine.admission.reserved_tokens()["draft KV pool"]

        def refuse_then_cancel():
            with pytest.raises(PoolExhaustedError, match="draft KV pool is full"):
                engine.add_request(prompt, params, speculative=True)
            return engine.cancel(running)

        worker, outcome = _in_thread(refuse_then_cancel)
        worker.join(WORKER_S)
        assert not worker.is_alive() and "error" not in outcome, outcome.get("error")
        assert outcome["value"] and chunks[-1].finish_reason == "cancelled"
        assert reserved == 40 and engine.admission.reserved_tokens()["draft KV pool"] == 0
        assert engine.load().in_flight == 0
        held.let_go()
        assert engine.num_live_states() == IDLE  # freed by the loop, on the device thread
        # the loop serves on: the pool has room for the request refused above
        assert [t for c in engine.stream(prompt, params, speculative=True) for t in c.token_ids] == \
            reference_generate(hybrid_target, prompt, 20)
    finally:
        held.let_go()
        engine.shutdown(drain=False, timeout=30)
    assert engine.num_live_states() == IDLE
    assert [c.finish_reason for c in chunks if c.finished] == ["cancelled"]
