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


class DrafterGeometryError(DSpineError, ValueError):
    """The sampled drafter's geometry differs from the greedy drafter's: the two share one draft KV
    pool and one verify layout, so every DraftArgs field but the tail's candidate counts must match.
    ``field`` names the first that differs. Raised when the engine is built, never by a request (so no gRPC code maps it)."""

    def __init__(self, field: str, greedy, sampled):
        super().__init__(f"sampled_draft_dir: the sampled drafter's {field} is {sampled!r}, the greedy drafter's "
                         f"{greedy!r}; both drafters must have the same DraftArgs (config.json) but "
                         f"head_topk and num_retrieve")
        self.field, self.greedy, self.sampled = field, greedy, sampled

    def __reduce__(self):
        return type(self), (self.field, self.greedy, self.sampled)


class RequestCancelledError(DSpineError):
    """The request was cancelled before it finished (-> CANCELLED)."""


class RequestFailedError(DSpineError):
    """An error inside one request ended it; its slots are freed (-> INTERNAL)."""


class EngineStoppedError(DSpineError):
    """The engine is shutting down and takes no new requests (-> UNAVAILABLE)."""


class PoolExhaustedError(DSpineError):
    """A request does not fit in one of the engine's memory pools now (-> RESOURCE_EXHAUSTED).

    ``pool`` names it ("target K/V", "draft KV pool"); ``needed`` tokens the request reserves,
    ``free`` of ``capacity`` not reserved by admitted requests."""

    def __init__(self, pool: str, needed: int, free: int, capacity: int):
        super().__init__(f"{pool} is full: the request needs {needed} tokens, {free} of {capacity} are free; "
                         "retry later or on another replica")
        self.pool, self.needed, self.free, self.capacity = pool, needed, free, capacity

    def __reduce__(self):
        return type(self), (self.pool, self.needed, self.free, self.capacity)


class RequestTooLargeError(PoolExhaustedError):
    """A request larger than a whole pool: it could never be admitted (-> RESOURCE_EXHAUSTED at add time)."""

    def __init__(self, pool: str, needed: int, free: int, capacity: int):
        DSpineError.__init__(self, f"{pool} can never hold this request: it needs {needed} tokens and the pool "
                                   f"holds {capacity}; shorten the prompt or max_new_tokens")
        self.pool, self.needed, self.free, self.capacity = pool, needed, free, capacity


class DraftPoolExhausted(DSpineError, RuntimeError):
    """Not enough free draft K/V slots (-> RESOURCE_EXHAUSTED at the edge)."""

    def __init__(self, requested: int, free: int, capacity: int):
        super().__init__(
            f"draft KV pool exhausted: {requested} slots requested, {free} free of {capacity}; "
            "finish or cancel requests, or size the pool larger"
        )
        self.requested = requested
        self.free = free
        self.capacity = capacity
