"""The ONE mapping from engine and validation errors to gRPC status codes.

=====================================  ====================  ===========================
exception                              status                details
=====================================  ====================  ===========================
InvalidRequestError, ValueError        INVALID_ARGUMENT      ``field: reason``
EngineFullError                        RESOURCE_EXHAUSTED    in flight / max_concurrency
NoDrafterError                         FAILED_PRECONDITION   ``speculative: ...``
RequestCancelledError                  CANCELLED
TimeoutError (a server-side deadline)  DEADLINE_EXCEEDED
EngineStoppedError                     UNAVAILABLE           retry on another replica
RequestFailedError, anything else      INTERNAL              no internals leak out
=====================================  ====================  ===========================

``NoDrafterError`` is also a ``ValueError``, so the order of the table matters.
The offending field also travels in the trailing metadata key ``dspine-field``
for clients that do not want to parse details.
"""

from __future__ import annotations

import logging

import grpc

from dspine.replica.errors import (
    EngineFullError,
    EngineStoppedError,
    InvalidRequestError,
    NoDrafterError,
    RequestCancelledError,
    RequestFailedError,
)

logger = logging.getLogger(__name__)

FIELD_METADATA_KEY = "dspine-field"

# Checked in order: subclasses before their bases.
_STATUS_BY_TYPE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NoDrafterError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestCancelledError, grpc.StatusCode.CANCELLED),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE),
    (RequestFailedError, grpc.StatusCode.INTERNAL),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def error_field(exc: BaseException) -> str | None:
    """The request field an error names: ``.field``, else the ``field:`` prefix of a ValueError."""
    field = getattr(exc, "field", None)
    if field:
        return str(field)
    if isinstance(exc, ValueError):
        head, sep, _ = str(exc).partition(":")
        if sep and head and " " not in head:
            return head
    return None


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """``(code, details)`` for an exception raised while serving a request."""
    for exc_type, code in _STATUS_BY_TYPE:
        if isinstance(exc, exc_type):
            if code is grpc.StatusCode.INTERNAL:
                return code, f"request failed: {exc}"
            return code, str(exc) or exc_type.__name__
    # A bug: log it with its traceback, keep internals out of the reply.
    logger.error("unexpected error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


async def abort(context, exc: BaseException):
    """Abort the RPC of ``context`` (a ``grpc.aio.ServicerContext``) with the status of ``exc``."""
    code, details = status_for(exc)
    named = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    field = error_field(exc) if named else None
    trailing = ((FIELD_METADATA_KEY, field),) if field and field.isascii() and field.isprintable() else ()
    await context.abort(code, details, trailing_metadata=trailing)
