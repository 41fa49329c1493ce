"""Server streams registered by ``add_to_server`` are cancelled inside an await, even when the
cancel lands while gRPC is writing a message (the race that kept Ray Serve's proxy streaming)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from ray.serve._private.grpc_util import gRPCGenericServer

from dspine import faults
from dspine.cluster.registration import SERVICE_NAME, add_to_server
from dspine.protos.dspine.v1 import dspine_pb2 as pb

pytestmark = pytest.mark.timeout(60)

MESSAGE_BYTES = 1 << 20  # far over a 64 KiB HTTP/2 window: the write of the second one waits
NO_WINDOW_GROWTH = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 8 * MESSAGE_BYTES),
                    ("grpc.max_send_message_length", 8 * MESSAGE_BYTES)]


class ProxyLikeServicer:
    """A stream shaped like Ray Serve 2.60's proxy: it cancels its upstream call only when a
    ``CancelledError`` reaches it inside an await (then reads the call's peer for its access
    log); a close at its ``yield`` is swallowed and nothing upstream is cancelled."""

    def __init__(self, raw: bool):
        self.raw = raw  # Serve's server sends the handler's bytes as they are
        self.outcome = None
        self.peer = None
        self.waiting_at_yield_since = None

    def __getattr__(self, rpc):  # the service's other methods: never called here
        async def unused(request, context):
            raise NotImplementedError(rpc)
        return unused

    async def GenerateStream(self, request, context):
        message = pb.GenerateStreamResponse(text="x" * MESSAGE_BYTES)
        try:
            while True:
                await asyncio.sleep(0)  # the proxy awaits the replica's next message
                self.waiting_at_yield_since = time.monotonic()
                yield message.SerializeToString() if self.raw else message
                self.waiting_at_yield_since = None
        except asyncio.CancelledError:
            self.peer = context.peer()
            self.outcome = "cancelled inside an await"
        except BaseException:  # noqa: BLE001 - as the proxy does: GeneratorExit is caught, nothing cancelled
            self.outcome = "closed at its yield"


def _serve_like_server(servicer: ProxyLikeServicer) -> grpc.aio.Server:
    """Ray Serve's own proxy server class: it replaces every registered handler by its factory's."""
    def factory(service_method, streaming_type):
        if service_method.endswith("/GenerateStream"):
            return servicer.GenerateStream
        return getattr(servicer, service_method.rsplit("/", 1)[-1])
    return gRPCGenericServer(factory, extra_options=NO_WINDOW_GROWTH)


async def _cancel_during_a_write(serve_server: bool) -> ProxyLikeServicer:
    servicer = ProxyLikeServicer(raw=serve_server)
    server = _serve_like_server(servicer) if serve_server else grpc.aio.server(options=NO_WINDOW_GROWTH)
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=NO_WINDOW_GROWTH) as channel:
            call = channel.unary_stream(f"/{SERVICE_NAME}/GenerateStream",
                                        request_serializer=pb.GenerateRequest.SerializeToString,
                                        response_deserializer=pb.GenerateStreamResponse.FromString)(
                pb.GenerateRequest(text="x"))
            assert len((await call.read()).text) == MESSAGE_BYTES
            # Read no more: the server's next write waits on flow control, its generator at the yield.
            end = time.monotonic() + 20
            while not (servicer.waiting_at_yield_since and time.monotonic() - servicer.waiting_at_yield_since > 0.3):
                assert time.monotonic() < end, "the server's write never blocked"
                await asyncio.sleep(0.02)
            call.cancel()
            end = time.monotonic() + 10
            while servicer.outcome is None and time.monotonic() < end:
                await asyncio.sleep(0.02)
            return servicer
    finally:
        await server.stop(grace=None)


@pytest.mark.parametrize("serve_server", [False, True], ids=["grpc-server", "serve-proxy-server"])
def test_a_stream_cancelled_during_a_write_is_cancelled_inside_an_await(serve_server):
    servicer = asyncio.run(_cancel_during_a_write(serve_server))
    assert servicer.outcome == "cancelled inside an await"
    assert isinstance(servicer.peer, str)  # read while the call was alive (after it, this can crash)


@pytest.mark.parametrize("serve_server", [False, True], ids=["grpc-server", "serve-proxy-server"])
def test_the_write_race_is_real_without_the_wrapper(serve_server):
    # The setup above does reproduce the race: registered as it is, the stream is only closed.
    with faults.inject("registration.stream_closed_at_yield"):
        assert asyncio.run(_cancel_during_a_write(serve_server)).outcome == "closed at its yield"
