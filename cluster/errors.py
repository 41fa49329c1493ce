"""The ONE mapping from engine and validation errors to gRPC status codes.

=====================================  ====================  ===========================
exception                              status                details
=====================================  ====================  ===========================
InvalidRequestError, ValueError        INVALID_ARGUMENT      ``field: reason``
EngineFullError                        RESOURCE_EXHAUSTED    in flight / max_concurrency
PoolExhaustedError, RequestTooLarge..  RESOURCE_EXHAUSTED    names the pool (target K/V, draft KV pool)
DraftPoolExhausted                     RESOURCE_EXHAUSTED    the draft KV pool
NoDrafterError                         FAILED_PRECONDITION   ``speculative: ...``
RequestCancelledError                  CANCELLED
TimeoutError (a server-side deadline)  DEADLINE_EXCEEDED
EngineStoppedError, ReplicaLostError  UNAVAILABLE           retry on another replica
ClusterBusyError                       RESOURCE_EXHAUSTED    every slot and queue place taken
EdgeBusyError                          RESOURCE_EXHAUSTED    too many calls waiting for a server thread
UnauthenticatedError                   UNAUTHENTICATED       missing or wrong bearer token
RequestFailedError, anything else      INTERNAL              no internals leak out
=====================================  ====================  ===========================

``NoDrafterError`` is also a ``ValueError``, so the order of the table matters.
The offending field also travels in the trailing metadata key ``dspine-field``
for clients that do not want to parse details.

Two ways out, one table: :func:`abort` for a ``grpc.aio`` servicer context
(the standalone server) and :func:`set_status` for Ray Serve's
``RayServegRPCContext`` (the cluster ingress).
"""

from __future__ import annotations

import logging

import grpc

from dspine.protos.metadata import FIELD_METADATA_KEY
from dspine.replica.errors import (
    EngineFullError,
    EngineStoppedError,
    InvalidRequestError,
    NoDrafterError,
    PoolExhaustedError,
    RequestCancelledError,
    DraftPoolExhausted,
    RequestFailedError,
)

logger = logging.getLogger(__name__)


class ClusterBusyError(Exception):
    """Every replica slot and every queue place of the cluster is taken (-> RESOURCE_EXHAUSTED)."""


class EdgeBusyError(Exception):
    """Too many calls of one kind (tokenization, admission) wait for the server's threads
    (-> RESOURCE_EXHAUSTED): refused at once rather than queued without bound."""


class UnauthenticatedError(Exception):
    """The call carries no valid bearer token (-> UNAUTHENTICATED)."""


class ReplicaLostError(Exception):
    """The replica serving a request died; the request cannot be resumed (-> UNAVAILABLE)."""



# Checked in order: subclasses before their bases.
_STATUS_BY_TYPE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NoDrafterError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PoolExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),  # RequestTooLargeError too (a subclass)
    (DraftPoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestCancelledError, grpc.StatusCode.CANCELLED),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE),
    (ReplicaLostError, grpc.StatusCode.UNAVAILABLE),
    (ClusterBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EdgeBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
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


def describe(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """``(code, details, trailing metadata)`` of ``exc``: what :func:`abort` and :func:`set_status` send."""
    code, details = status_for(exc)
    named = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    field = error_field(exc) if named else None
    trailing = ((FIELD_METADATA_KEY, field),) if field and field.isascii() and field.isprintable() else ()
    return code, details, trailing


async def abort(context, exc: BaseException, described=None):
    """Abort the RPC of ``context`` (a ``grpc.aio.ServicerContext``) with the status of ``exc``
    (``described``: its :func:`describe`, when the caller already has it)."""
    code, details, trailing = described or describe(exc)
    await context.abort(code, details, trailing_metadata=trailing)


def set_status(grpc_context, exc: BaseException) -> grpc.StatusCode:
    """Set the status of ``exc`` on a Ray Serve ``RayServegRPCContext``; the handler then returns.

    Serve keeps a code set by the handler (a plain exception would become
    INTERNAL with a Ray traceback in the details)."""
    code, details, trailing = describe(exc)
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    if trailing:
        grpc_context.set_trailing_metadata(list(trailing))
    return code
