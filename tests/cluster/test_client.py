"""Client SDK behaviour that needs no server: retries (sync and asyncio faces), request building, trace
context, imports."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from dspine.cluster.client import AsyncDSpineClient, DSpineClient, RetryPolicy, build_generate_request
from dspine.cluster.client.retry import Attempts, Deadline
from dspine.cluster.client.spans import trace_metadata
from dspine.cluster.client_errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from dspine.protos.dspine.v1 import dspine_pb2 as pb

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.002)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return f"fake {self._code.name}"

    def trailing_metadata(self):
        return ()


def failing(codes, result):
    """A stub method failing with ``codes`` in turn, then returning ``result``; counts calls."""
    calls = []

    def method(request, timeout=None, metadata=None):
        calls.append(timeout)
        if len(calls) <= len(codes):
            raise FakeRpcError(codes[len(calls) - 1])
        return result

    return method, calls


@pytest.fixture
def client():
    with DSpineClient("127.0.0.1:1", retry=FAST) as c:  # never connects: stubs are faked
        yield c


def test_unary_retried_on_unavailable(client):
    method, calls = failing([grpc.StatusCode.UNAVAILABLE] * 2, pb.TokenizeResponse(token_ids=[4, 2]))
    client._stub.Tokenize = method
    assert client.tokenize("x") == [4, 2]
    assert len(calls) == 3


def test_unary_gives_up_after_max_attempts(client):
    method, calls = failing([grpc.StatusCode.UNAVAILABLE] * 9, None)
    client._stub.GetModelInfo = method
    with pytest.raises(Unavailable):
        client.info()
    assert len(calls) == FAST.max_attempts


def test_other_codes_not_retried(client):
    method, calls = failing([grpc.StatusCode.RESOURCE_EXHAUSTED], None)
    client._stub.Generate = method
    with pytest.raises(ResourceExhausted) as info:
        client.generate(token_ids=[1])
    assert len(calls) == 1 and info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details == "fake RESOURCE_EXHAUSTED"


def test_retries_respect_the_deadline(client):
    method, calls = failing([grpc.StatusCode.UNAVAILABLE] * 9, None)
    client._stub.Detokenize = method
    slow = RetryPolicy(max_attempts=9, initial_backoff_s=10.0, max_backoff_s=10.0)
    client.retry = slow
    with pytest.raises(Unavailable):
        client.detokenize([1], timeout=0.5)
    assert len(calls) == 1  # the backoff would outlive the deadline
    assert 0 < calls[0] <= 0.5


class FakeStreamCall:
    def __init__(self, items):
        self._items = iter(items)
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._items)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def test_stream_retried_only_before_first_message(client):
    chunk = pb.GenerateStreamResponse(request_id="r", token_ids=[7])
    starts = []
    plans = [[FakeRpcError(grpc.StatusCode.UNAVAILABLE)],  # fails before any message: retried
             [chunk, FakeRpcError(grpc.StatusCode.UNAVAILABLE)]]  # fails after one: never retried

    def start(request, timeout=None, metadata=None):
        starts.append(FakeStreamCall(plans[len(starts)]))
        return starts[-1]

    client._stub.GenerateStream = start
    stream = client.generate_stream(token_ids=[1])
    assert next(stream).token_ids == [7]
    with pytest.raises(Unavailable):
        next(stream)
    assert len(starts) == 2
    stream.cancel()
    assert starts[-1].cancelled


def test_build_request():
    request = build_generate_request(token_ids=[1, 2], max_new_tokens=5, temperature=0.0, stop=["\n"],
                                     speculative=False, request_id="r1")
    assert request.WhichOneof("prompt") == "token_ids" and list(request.token_ids.ids) == [1, 2]
    assert request.sampling.HasField("temperature") and not request.sampling.HasField("top_p")
    assert request.HasField("speculative") and not request.speculative
    chat = build_generate_request(messages=[{"role": "user", "content": "hi"}, ("assistant", "yo")])
    assert [m.role for m in chat.messages.messages] == ["user", "assistant"]
    assert not build_generate_request("hi").HasField("speculative")
    with pytest.raises(InvalidArgument) as info:
        build_generate_request("a", token_ids=[1])
    assert info.value.field == "prompt"
    with pytest.raises(InvalidArgument) as info:
        build_generate_request(token_ids=[1], seed=-1)  # uint64 on the wire
    assert info.value.field == "sampling.seed"
    with pytest.raises(InvalidArgument):
        build_generate_request(token_ids=[2**64])


def test_trace_context_injected_when_a_span_is_active(client):
    trace = pytest.importorskip("opentelemetry.trace")
    from opentelemetry.sdk.trace import TracerProvider

    assert trace_metadata() == []  # no active span
    tracer = TracerProvider().get_tracer("test")
    seen = []
    client._stub.GetModelInfo = lambda request, timeout=None, metadata=None: seen.append(metadata) or pb.ModelInfo()
    with tracer.start_as_current_span("outer") as span:
        client.info()
        trace_id = format(span.get_span_context().trace_id, "032x")
    metadata = dict(seen[0])
    assert trace_id in metadata["traceparent"]
    assert trace.get_current_span().get_span_context().is_valid is False


def test_client_imports_without_ray_or_torch():
    code = ("import sys; import dspine.cluster.client, dspine.cluster.client_errors; "
            "bad = [m for m in ('ray', 'torch', 'dspine.replica') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------ the asyncio face shares the core
def run_async(make_test):
    """Run ``make_test(client)`` on an AsyncDSpineClient (never connects: stubs are faked)."""
    async def main():
        async with AsyncDSpineClient("127.0.0.1:1", retry=FAST) as client:
            return await make_test(client)

    return asyncio.run(main())


def async_failing(codes, result):
    method, calls = failing(codes, result)

    async def async_method(request, timeout=None, metadata=None):
        return method(request, timeout, metadata)

    return async_method, calls


def test_async_unary_retries_and_typed_errors_as_the_sync_client():
    tokenize, tokenize_calls = async_failing([grpc.StatusCode.UNAVAILABLE] * 2, pb.TokenizeResponse(token_ids=[3]))
    generate, generate_calls = async_failing([grpc.StatusCode.RESOURCE_EXHAUSTED], None)

    async def check(client):
        client._stub.Tokenize, client._stub.Generate = tokenize, generate
        assert await client.tokenize("x") == [3]
        with pytest.raises(ResourceExhausted):
            await client.generate(token_ids=[1])

    run_async(check)
    assert (len(tokenize_calls), len(generate_calls)) == (3, 1)


class FakeAsyncStreamCall:
    def __init__(self, items):
        self._items = list(items)
        self.cancelled = False

    async def read(self):
        if not self._items:
            return grpc.aio.EOF
        item = self._items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def test_async_stream_retried_only_before_first_message():
    chunk = pb.GenerateStreamResponse(request_id="r", token_ids=[7])
    last = pb.GenerateStreamResponse(request_id="r", token_ids=[8], finish_reason=pb.FINISH_REASON_LENGTH)
    plans = [[FakeRpcError(grpc.StatusCode.UNAVAILABLE)], [chunk, last],  # the first stream: retried, then ends
             [chunk, FakeRpcError(grpc.StatusCode.UNAVAILABLE)]]  # the second fails after a message: not retried
    starts = []

    def start(request, timeout=None, metadata=None):
        starts.append(FakeAsyncStreamCall(plans[len(starts)]))
        return starts[-1]

    async def check(client):
        client._stub.GenerateStream = start
        chunks = [c async for c in client.generate_stream(token_ids=[1])]
        assert [c.token_ids for c in chunks] == [[7], [8]] and chunks[-1].finish_reason == "length"
        stream = client.generate_stream(token_ids=[1])
        assert (await stream.__anext__()).token_ids == [7]
        with pytest.raises(Unavailable):
            await stream.__anext__()

    run_async(check)
    assert len(starts) == 3


def test_health_is_one_try(client):
    method, calls = failing([grpc.StatusCode.UNAVAILABLE] * 9, None)
    client._health_stub = type("FakeHealth", (), {"Check": staticmethod(method)})()
    with pytest.raises(Unavailable):
        client.health()
    assert len(calls) == 1  # a health check reports what it finds, it does not wait it out


def test_attempts_stop_at_the_deadline_and_on_codes_not_retried():
    with pytest.raises(DeadlineExceeded):
        next(iter(Attempts(FAST, Deadline(0.0))))
    attempts = Attempts(FAST, Deadline(None))
    assert 0 < attempts.backoff_after(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) <= FAST.max_backoff_s * 1.2
    with pytest.raises(ResourceExhausted):
        attempts.backoff_after(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED))
    spent = Attempts(RetryPolicy(max_attempts=2, initial_backoff_s=0.001), Deadline(None))
    spent.backoff_after(FakeRpcError(grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(Unavailable):  # two tries in all
        spent.backoff_after(FakeRpcError(grpc.StatusCode.UNAVAILABLE))
