"""Registering the dspine.v1 service on a gRPC server, with a deserializer that never fails a call.

``add_DSpineServicer_to_server`` (the generated stubs) lets a request whose bytes
do not parse fail inside gRPC with a bare INTERNAL. :func:`add_to_server`
registers the same methods with a tolerant deserializer instead: such a
request reaches the servicer as a :class:`~dspine.cluster.wire_checks.MalformedMessage`
and gets INVALID_ARGUMENT saying what is wrong. Ray Serve's gRPC proxy calls it
too (``grpc_servicer_functions``, by its import path ``dspine.cluster.servicer.add_to_server``).

A server stream written as an async generator (the proxy's handlers are) is
also wrapped by :func:`cancel_at_an_await`, which writes its messages itself.
gRPC cancels a call by cancelling its task; left to gRPC, a generator whose
call ends while gRPC writes a message stays at its ``yield`` and is closed
with ``GeneratorExit`` only after the call is gone. Ray Serve
2.60's proxy cancels the replica's call only on a ``CancelledError`` met
inside an ``await`` (``ProxyResponseGenerator.__anext__``); a close at the
yield is caught as an error and the replica streams on, holding its engine
slot until the request ends by itself (seen as ``GeneratorExit`` at
``proxy.py: yield result`` in the proxy log; 4 of 42 rounds of two cancels here).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging

from google.protobuf.message import DecodeError, Message

from dspine import faults
from dspine.protos.dspine.v1 import dspine_pb2 as pb

from .wire_checks import MalformedMessage

__all__ = ["SERVICE_NAME", "add_to_server", "cancel_at_an_await"]

logger = logging.getLogger(__name__)

# A handler resumed after its write failed reaches its next await in one step; a few tries cover
# messages that were already waiting.
_CANCEL_TRIES = 4

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DSpine"].full_name  # "dspine.v1.DSpine"


def _tolerant(message_type: type[Message]):
    def deserialize(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return MalformedMessage(message_type, e)
    return deserialize


def add_to_server(servicer, server) -> None:
    """Register ``servicer`` like ``add_DSpineServicer_to_server``, but a request that does not
    parse reaches the servicer (and gets INVALID_ARGUMENT) instead of failing inside gRPC."""
    import grpc

    wrap_streams = not faults.active("registration.stream_closed_at_yield")
    if wrap_streams:
        _wrap_serve_proxy_streams(server)
    methods = pb.DESCRIPTOR.services_by_name["DSpine"].methods
    handlers = {}
    for method in methods:
        request_type = _message_class(method.input_type.name)
        response_type = _message_class(method.output_type.name)
        factory = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                   else grpc.unary_unary_rpc_method_handler)
        handler = getattr(servicer, method.name)
        if wrap_streams and method.server_streaming and inspect.isasyncgenfunction(handler):
            handler = cancel_at_an_await(handler)
        handlers[method.name] = factory(handler, request_deserializer=_tolerant(request_type),
                                        response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _wrap_serve_proxy_streams(server) -> None:
    """Ray Serve's proxy server replaces every registered handler by one its
    ``service_handler_factory`` makes (routing to the replicas), so the streams are wrapped there."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        if type(server).__module__.startswith("ray."):
            logger.warning("Ray Serve's gRPC server has no service_handler_factory: a stream cancelled during "
                           "a write may keep its replica call running")
        return
    if getattr(factory, "cancels_at_an_await", False):
        return  # several services registered on one server

    def make_handler(*args, **kwargs):
        handler = factory(*args, **kwargs)
        return cancel_at_an_await(handler) if inspect.isasyncgenfunction(handler) else handler

    make_handler.cancels_at_an_await = True
    server.service_handler_factory = make_handler


def cancel_at_an_await(handler):
    """Turn a server-streaming async generator function into a handler that writes each message
    itself (``context.write``), so that a call which ends during a write (cancelled, or past its
    deadline) raises here, while the call is still alive, and is passed on as a cancel inside an
    ``await`` of the generator, where cancellation-aware code (Ray Serve's proxy cancelling the
    replica's call) sees it. Left to gRPC, such a generator is only closed at its ``yield``, after
    the call is gone (touching its context then can crash the process)."""

    async def stream(request, context):
        async with contextlib.aclosing(handler(request, context)) as responses:
            async for message in responses:
                try:
                    await context.write(message)
                except asyncio.CancelledError:  # the call ended: ``responses`` waits at its yield
                    await _cancel_inside_an_await(responses)
                    raise
                except Exception:  # noqa: BLE001 - a write refused by a call that is over: nothing to report
                    await _cancel_inside_an_await(responses)
                    return

    stream.__name__ = getattr(handler, "__name__", "stream")
    return stream


async def _cancel_inside_an_await(responses) -> None:
    """Resume ``responses`` until it waits on something, then cancel it there. gRPC may cancel
    this call's task meanwhile (a failed write comes first): that waits until it is done."""
    passing_on = asyncio.ensure_future(_resume_and_cancel(responses))
    while not passing_on.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(passing_on)


async def _resume_and_cancel(responses) -> None:
    with contextlib.suppress(BaseException):  # whatever it ends with, the call is over
        for _ in range(_CANCEL_TRIES):
            step = asyncio.ensure_future(responses.__anext__())
            await asyncio.sleep(0)  # let it run to its first await
            if step.done():  # a message was ready: drop it and try again
                if step.exception() is not None:
                    break
                continue
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
            break


def _message_class(name: str) -> type[Message]:
    return getattr(pb, name)  # every dspine.v1 message is a module attribute of dspine_pb2
