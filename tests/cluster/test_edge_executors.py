"""The edge stays responsive: tokenization never holds up admission or cancellation, and a full
engine says so while a step holds the engine (issue 20, items 7 and 8).

No test here depends on timing: a test hook holds the work in the way (tokenize threads blocked
on a ``threading.Event``, the engine held inside a step) for as long as the test needs, and the
test checks that the other call is answered before it lets go. The deadlines only bound how long
a broken build takes to fail. Each guarantee fails with its fault point injected
(``servicer.shared_executor``, ``servicer.admission_waits_for_engine``).
"""

from __future__ import annotations

import threading

import grpc
import pytest

from dspine import faults
from dspine.cluster.client import DSpineClient, RetryPolicy
from dspine.cluster.client_errors import DeadlineExceeded, ResourceExhausted
from dspine.protos.dspine.v1 import dspine_pb2 as pb
from dspine.protos.dspine.v1 import dspine_pb2_grpc as pb_grpc

from .conftest import idle, make_engine, wait_until

BLOCKED_TEXT = "hold this tokenize thread"


class BlockingTokenizer:
    """The server's tokenizer, except that encoding :data:`BLOCKED_TEXT` waits for ``release``."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.release = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()

    def encode(self, text, add_special_tokens=True):
        if text == BLOCKED_TEXT:
            with self._lock:
                self.entered += 1
            assert self.release.wait(60), "BlockingTokenizer: never released"
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(params=[None, "servicer.shared_executor"], ids=["fixed", "shared-executor"])
def tokenization_jammed(request, serve, gate_for, tokenizer):
    """A server with one stream in flight (the closed gate holds its steps) whose tokenize threads
    are then all held by blocked Tokenize calls, more waiting for them. Yields ``(engine, gate,
    client, stream)``; ``request.param`` (a fault point or None) is active throughout."""
    fault = request.param
    with faults.inject(*([fault] if fault else [])):
        yield from _jam(serve, gate_for, tokenizer)


def _jam(serve, gate_for, tokenizer):
    engine = make_engine(tokenizer, with_drafter=False)
    gate = gate_for(engine)
    server = serve(engine)
    client = DSpineClient(server.address, timeout=60, retry=RetryPolicy(max_attempts=1))
    stream = client.generate_stream(token_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True)
    wait_until(lambda: engine.num_unfinished() == 1, 15, "the first stream admitted")
    service = server.server.servicer.service
    blocking = BlockingTokenizer(service.tokenizer)
    service.tokenizer = blocking
    pool = service.executors.tokenize_pool()
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.DSpineStub(channel)
    calls = [stub.Tokenize.future(pb.TokenizeRequest(text=BLOCKED_TEXT), timeout=90) for _ in range(pool.threads + 3)]
    try:
        wait_until(lambda: blocking.entered == pool.threads and pool.pending == len(calls), 20,
                   "every tokenize thread held, three calls waiting")
        yield engine, gate, client, stream
        assert blocking.entered == pool.threads, "a tokenize call ran while the threads were held"
    finally:
        blocking.release.set()
        results = [call.result() for call in calls]
        channel.close()
        gate.open()
        client.close()
    assert all(len(r.token_ids) > 0 for r in results)  # the held calls finish normally once released
    wait_until(lambda: idle(engine), what="no live state")


def _admission_goes_through(engine, gate, client, stream, wait_s: float):
    second = client.generate_stream("def wrap(text, width):", max_new_tokens=4)
    # a text prompt: encoded and admitted by the admission threads
    wait_until(lambda: engine.num_unfinished() == 2, wait_s, "the text prompt admitted")
    gate.open()
    chunks = list(second)
    assert chunks[-1].finish_reason in ("stop", "length")
    assert sum(len(c.token_ids) for c in chunks) <= 4


def _cancel_goes_through(engine, gate, client, stream, wait_s: float):
    stream.cancel()
    wait_until(lambda: engine.num_unfinished() == 0, wait_s, "the cancel freed the request")


@pytest.mark.parametrize("call", [_admission_goes_through, _cancel_goes_through], ids=["admission", "cancel"])
def test_admission_and_cancel_go_through_while_tokenization_fills_its_threads(request, tokenization_jammed, call):
    if request.node.callspec.params["tokenization_jammed"] is None:  # no fault injected
        call(*tokenization_jammed, wait_s=15)
        return
    # the old design: admission and cancel wait behind the held tokenize calls
    with pytest.raises(AssertionError, match="the text prompt admitted|the cancel freed the request"):
        call(*tokenization_jammed, wait_s=3)


class StepHold:
    """Holds the engine inside its next step (the model running, the engine lock held) until released."""

    def __init__(self, engine):
        self._execute = engine.runner.execute
        self.inside = threading.Event()
        self.release = threading.Event()
        engine.runner.execute = self._held

    def _held(self, *args, **kwargs):
        self.inside.set()
        assert self.release.wait(60), "StepHold: never released"
        return self._execute(*args, **kwargs)


def _fill_and_hold(serve, gate_for, engine, requests):
    """Start ``requests`` ((token ids, max_new_tokens, speculative) each) as streams, then hold the
    engine inside the step that runs them. Returns (server, client, hold, stub calls of the streams)."""
    gate = gate_for(engine)
    server = serve(engine)
    stub = pb_grpc.DSpineStub(grpc.insecure_channel(server.address))
    streams = [stub.GenerateStream(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), speculative=spec,
                                                      sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True)),
                                   timeout=90) for ids, n, spec in requests]
    wait_until(lambda: engine.num_unfinished() == len(requests), 20, "all admitted")
    hold = StepHold(engine)
    gate.open()
    assert hold.inside.wait(20), "the engine never stepped"
    client = DSpineClient(server.address, timeout=60, retry=RetryPolicy(max_attempts=1))
    return server, client, hold, streams


# The old design: the edge finds a full engine only through engine.add_request, and that waits
# for the lock a step holds while the model runs (either fix alone answers at once).
_OLD_ADMISSION = ("servicer.admission_waits_for_engine", "engine.admission_waits_for_step")


@pytest.mark.parametrize("fault", [None, _OLD_ADMISSION], ids=["fixed", "waits-for-engine"])
def test_a_full_engine_refuses_while_a_step_holds_the_engine(serve, gate_for, fault):
    engine = make_engine(with_drafter=False, max_concurrency=2)
    server, client, hold, streams = _fill_and_hold(serve, gate_for, engine, [([3, 4], 8, False), ([5, 6], 8, False)])
    try:
        with faults.inject(*(fault or ())):
            expected = DeadlineExceeded if fault else ResourceExhausted  # with the bug: stuck behind the step
            with pytest.raises(expected) as refused:
                client.generate(token_ids=[7, 8], max_new_tokens=2, timeout=3)
        assert hold.inside.is_set() and not hold.release.is_set()  # answered while the step was still held
        if fault is None:
            assert "max_concurrency=2" in refused.value.details
    finally:
        hold.release.set()
    for stream in streams:
        assert list(stream)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    client.close()
    wait_until(lambda: idle(engine), what="no live state")


@pytest.mark.parametrize("fault", [None, "engine.admission_waits_for_step"], ids=["fixed", "waits-for-step"])
def test_a_request_the_draft_pool_cannot_hold_is_refused_while_a_step_holds_the_engine(serve, gate_for, fault):
    # 40 draft slots; the held request reserves 20 + 10 = 30, the second needs 30 as well: the
    # engine's memory admission (not the slot count) refuses it, and it does not wait for the step.
    engine = make_engine(draft_pool_tokens=41, admission_when_full="refuse")
    server, client, hold, streams = _fill_and_hold(serve, gate_for, engine, [([3] * 20, 10, True)])
    try:
        with faults.inject(*([fault] if fault else [])):
            if fault:
                with pytest.raises(DeadlineExceeded):  # with the bug: stuck behind the step
                    client.generate(token_ids=[4] * 20, max_new_tokens=10, speculative=True, timeout=3)
            else:
                with pytest.raises(ResourceExhausted, match="draft KV pool is full"):
                    client.generate(token_ids=[4] * 20, max_new_tokens=10, speculative=True, timeout=3)
        assert not hold.release.is_set()
    finally:
        hold.release.set()
        for stream in streams:
            list(stream)
        client.close()


@pytest.mark.parametrize("fault", [None, "servicer.admission_waits_for_engine"], ids=["fixed", "waits-for-engine"])
def test_admissions_in_progress_hold_their_slots(serve, gate_for, tokenizer, fault):
    # Two text prompts are still being encoded (held by the test hook) on an engine of 2 slots:
    # the engine holds no request yet, but both slots are claimed, so a third request is refused
    # at once instead of overtaking them.
    engine = make_engine(tokenizer, with_drafter=False, max_concurrency=2)
    gate_for(engine)
    server = serve(engine)
    service = server.server.servicer.service
    blocking = BlockingTokenizer(service.tokenizer)
    service.tokenizer = blocking
    with DSpineClient(server.address, timeout=60, retry=RetryPolicy(max_attempts=1)) as client:
        held = [client.generate_stream(BLOCKED_TEXT, max_new_tokens=2) for _ in range(2)]
        try:
            wait_until(lambda: blocking.entered == 2, 20, "both text prompts being encoded")
            assert engine.num_unfinished() == 0
            with faults.inject(*([fault] if fault else [])):
                if fault is None:
                    with pytest.raises(ResourceExhausted, match="max_concurrency=2"):
                        client.generate(token_ids=[7, 8], max_new_tokens=2, timeout=10)
                else:  # the bug: the third request overtakes the two that came first
                    third = client.generate_stream(token_ids=[7, 8], max_new_tokens=2, timeout=10)
                    wait_until(lambda: engine.num_unfinished() == 1, 10, "the third request admitted")
                    third.cancel()
        finally:
            blocking.release.set()
            for stream in held:
                stream.cancel()
    wait_until(lambda: idle(engine), what="no live state")
