"""Registering the dspine.v1 service on a gRPC server, with a deserializer that never fails a call.

``add_DSpineServicer_to_server`` (the generated stubs) lets a request whose bytes
do not parse fail inside gRPC with a bare INTERNAL. :func:`add_to_server`
registers the same methods with a tolerant deserializer instead: such a
request reaches the servicer as a :class:`~dspine.cluster.wire_checks.MalformedMessage`
and gets INVALID_ARGUMENT saying what is wrong. Ray Serve's gRPC proxy calls it
too (``grpc_servicer_functions``, by its import path ``dspine.cluster.servicer.add_to_server``).
"""

from __future__ import annotations

from google.protobuf.message import DecodeError, Message

from dspine.protos.dspine.v1 import dspine_pb2 as pb

from .wire_checks import MalformedMessage

__all__ = ["SERVICE_NAME", "add_to_server"]

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

    methods = pb.DESCRIPTOR.services_by_name["DSpine"].methods
    handlers = {}
    for method in methods:
        request_type = _message_class(method.input_type.name)
        response_type = _message_class(method.output_type.name)
        factory = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                   else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = factory(getattr(servicer, method.name), request_deserializer=_tolerant(request_type),
                                        response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _message_class(name: str) -> type[Message]:
    return getattr(pb, name)  # every dspine.v1 message is a module attribute of dspine_pb2
