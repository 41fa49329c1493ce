"""Checks of a request's wire form, before any field is read: it parsed, and every field is known.

protobuf parses leniently: bytes it cannot use end up in a message's unknown
fields instead of failing the parse. Two different client mistakes land there,
and each gets its own INVALID_ARGUMENT:

- a field number this schema does not have (a newer client): "unknown field
  number N in M; this server does not support it";
- a field this schema DOES have, sent with the wrong wire type (a client built
  from a different .proto, or a hand-written encoder): the message names the
  field and says which wire type it takes and which one came.

A request whose bytes do not parse at all reaches the service as a
:class:`MalformedMessage` (see :mod:`dspine.cluster.registration`).
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from dspine.replica.errors import InvalidRequestError

__all__ = ["MalformedMessage", "check_wire", "expected_wire_types"]

_WIRE_TYPE_NAMES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "start-group", 4: "end-group",
                    5: "32-bit"}

_F = FieldDescriptor
_VARINT_TYPES = frozenset({_F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64, _F.TYPE_SINT32,
                           _F.TYPE_SINT64, _F.TYPE_BOOL, _F.TYPE_ENUM})
_FIXED64_TYPES = frozenset({_F.TYPE_DOUBLE, _F.TYPE_FIXED64, _F.TYPE_SFIXED64})
_FIXED32_TYPES = frozenset({_F.TYPE_FLOAT, _F.TYPE_FIXED32, _F.TYPE_SFIXED32})


class MalformedMessage:
    """Stands in for a request whose bytes did not parse (see :func:`~dspine.cluster.registration.add_to_server`)."""

    def __init__(self, message_type: type[Message], error: Exception):
        self.message_type = message_type
        self.error = error


def expected_wire_types(field: FieldDescriptor) -> tuple[int, ...]:
    """The wire types a parser accepts for ``field``: its scalar type's, and for a repeated
    number field also length-delimited (the packed form)."""
    if field.type in _VARINT_TYPES:
        scalar = 0
    elif field.type in _FIXED64_TYPES:
        scalar = 1
    elif field.type in _FIXED32_TYPES:
        scalar = 5
    elif field.type == _F.TYPE_GROUP:
        return (3,)
    else:  # string, bytes, message (and map entries)
        return (2,)
    return (scalar, 2) if field.is_repeated else (scalar,)


def _wire_name(wire_type: int) -> str:
    return f"{wire_type} ({_WIRE_TYPE_NAMES.get(wire_type, 'invalid')})"


def check_wire(request) -> None:
    """Reject undecodable bytes, unknown field numbers and known fields sent with the wrong wire type."""
    if isinstance(request, MalformedMessage):
        raise InvalidRequestError(
            "request", f"not a valid {request.message_type.DESCRIPTOR.full_name} "
                       f"(malformed protobuf or invalid UTF-8 in a string): {request.error}")
    _check_unknown(request, "")


def _unknown_field_error(message: Message, path: str, number: int, wire_type: int) -> InvalidRequestError:
    field = message.DESCRIPTOR.fields_by_number.get(number)
    if field is None:
        where = f"{path}.#{number}" if path else f"#{number}"
        return InvalidRequestError(
            where, f"unknown field number {number} in {message.DESCRIPTOR.full_name}; this server does not support it")
    where = f"{path}.{field.name}" if path else field.name
    expected = " or ".join(_wire_name(w) for w in expected_wire_types(field))
    return InvalidRequestError(
        where, f"sent with wire type {_wire_name(wire_type)}, but field {number} of "
               f"{message.DESCRIPTOR.full_name} takes wire type {expected}; the client's schema does not match")


def _check_unknown(message: Message, path: str) -> None:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        raise _unknown_field_error(message, path, unknown[0].field_number, unknown[0].wire_type)
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        sub = f"{path}.{field.name}" if path else field.name
        if field.message_type.GetOptions().map_entry:  # a map iterates as its keys
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    _check_unknown(item, f"{sub}[{key!r}]")
            continue
        if field.is_repeated:
            for i, item in enumerate(value):
                _check_unknown(item, f"{sub}[{i}]")
        else:
            _check_unknown(value, sub)
