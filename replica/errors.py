"""Typed errors of the engine.

The cluster edge maps each class to one gRPC status code in one place
(``dspine.cluster.errors``); nothing here knows about gRPC.
"""

from __future__ import annotations


class DSpineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(DSpineError, ValueError):
    """A request field is invalid. ``field`` names it (-> INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # crosses process boundaries (Ray) with both arguments
        return type(self), (self.field, self.message)


class EngineFullError(DSpineError):
    """The engine already holds ``max_concurrency`` requests (-> RESOURCE_EXHAUSTED)."""

    def __init__(self, in_flight: int, max_concurrency: int):
        super().__init__(
            f"engine is full: {in_flight} requests in flight, max_concurrency={max_concurrency}; retry later"
        )
        self.in_flight = in_flight
        self.max_concurrency = max_concurrency

    def __reduce__(self):
        return type(self), (self.in_flight, self.max_concurrency)


class NoDrafterError(DSpineError, ValueError):
    """Speculation was asked for but no drafter is loaded (-> FAILED_PRECONDITION)."""


class RequestCancelledError(DSpineError):
    """The request was cancelled before it finished (-> CANCELLED)."""


class RequestFailedError(DSpineError):
    """An error inside one request ended it; its slots are freed (-> INTERNAL)."""


class EngineStoppedError(DSpineError):
    """The engine is shutting down and takes no new requests (-> UNAVAILABLE)."""
