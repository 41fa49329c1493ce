"""Typed errors of the client SDK: one class per gRPC status a dspine server returns.

Every class has ``.code`` (``grpc.StatusCode``) and ``.details`` (the server's
message); :class:`InvalidArgument` and :class:`FailedPrecondition` also have
``.field``, the request field the server named (``"sampling.temperature"``).
"""

from __future__ import annotations

import re

import grpc

from dspine.protos.metadata import FIELD_METADATA_KEY

__all__ = [
    "DSpineClientError",
    "InvalidArgument",
    "FailedPrecondition",
    "ResourceExhausted",
    "Cancelled",
    "DeadlineExceeded",
    "Unavailable",
    "Unauthenticated",
    "Internal",
    "from_rpc_error",
]



class DSpineClientError(Exception):
    """A failed call; ``code`` is the gRPC status, ``details`` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None, field: str | None = None):
        super().__init__(f"{(code or self.code).name}: {details}")
        if code is not None:
            self.code = code
        self.details = details
        self.field = field


class InvalidArgument(DSpineClientError, ValueError):
    """A request field is invalid; ``field`` names it."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(DSpineClientError):
    """The server cannot serve this kind of request (e.g. speculative=True without a drafter)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(DSpineClientError):
    """The replica is full (or the message too large); retry later or elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Cancelled(DSpineClientError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(DSpineClientError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(DSpineClientError, ConnectionError):
    """The server is unreachable or shutting down; unary calls are retried before this is raised."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(DSpineClientError, PermissionError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Internal(DSpineClientError):
    """A failure inside the server while serving the request."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, FailedPrecondition, ResourceExhausted, Cancelled,
                                      DeadlineExceeded, Unavailable, Unauthenticated, Internal)}


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]#]*): ")


def _field(error: grpc.RpcError, details: str) -> str | None:
    """The field the server named: trailing metadata, else the ``field: reason`` prefix of the
    details (Ray Serve's proxy drops trailing metadata of a stream that fails)."""
    try:
        for key, value in error.trailing_metadata() or ():
            if key == FIELD_METADATA_KEY:
                return value
    except Exception:  # noqa: BLE001 - a call object without metadata (e.g. a local failure)
        pass
    match = _FIELD_PREFIX.match(details)
    return match.group(1) if match else None


def from_rpc_error(error: grpc.RpcError) -> DSpineClientError:
    """The typed error for a failed call (unknown codes give the base class with that code)."""
    code, details = error.code(), error.details() or ""
    cls = _BY_CODE.get(code)
    if cls is None:
        return DSpineClientError(details, code=code)
    field = _field(error, details) if cls in (InvalidArgument, FailedPrecondition) else None
    return cls(details, field=field)
