"""The SDK's call policy: retries on UNAVAILABLE with backoff, under one deadline for the whole call.

Sans-I/O: :class:`Attempts` decides (what timeout a try gets, whether and how long to back off);
the sync and asyncio clients only call and sleep, each in its own way.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import grpc

from ..client_errors import DeadlineExceeded, from_rpc_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of unary calls on UNAVAILABLE: ``max_attempts`` tries in all, exponential backoff."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # +- fraction of each delay
    retry_codes: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * (1.0 + random.uniform(-self.jitter, self.jitter))


NO_RETRY = RetryPolicy(max_attempts=1)


class Deadline:
    """The end of a whole call (every retry included); ``None``: no deadline."""

    def __init__(self, timeout: float | None):
        self.end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def allows_sleep(self, seconds: float) -> bool:
        remaining = self.remaining()
        return remaining is None or remaining > seconds


class Attempts:
    """The tries of one call. Iterate for each try (its ``timeout`` is what the deadline leaves) and
    run the RPC inside ``with attempt:``; a retryable failure is swallowed and ``backoff`` says how
    long to sleep before the next try, any other becomes its typed :mod:`client_errors` error::

        for attempt in Attempts(policy, Deadline(timeout)):
            with attempt:
                return stub.Method(request, timeout=attempt.timeout)
            time.sleep(attempt.backoff)
    """

    def __init__(self, policy: RetryPolicy, deadline: Deadline, target: str = ""):
        self.policy, self.deadline, self.target = policy, deadline, target
        self.number = 1  # of the try under way
        self.timeout: float | None = None
        self.backoff = 0.0

    def __iter__(self):
        while True:
            remaining = self.deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded("deadline exceeded before the call could be (re)tried")
            self.timeout = remaining
            yield self

    def __enter__(self) -> "Attempts":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if not isinstance(error, grpc.RpcError):
            return False
        self.backoff = self.backoff_after(error)
        return True

    def backoff_after(self, error: grpc.RpcError) -> float:
        """Seconds to wait before the next try after ``error``; raises ``error`` as its typed
        client error when the code is not retried, the tries are spent or the wait would outlive
        the deadline."""
        if error.code() in self.policy.retry_codes and self.number < self.policy.max_attempts:
            delay = self.policy.delay(self.number)
            if self.deadline.allows_sleep(delay):
                logger.debug("%s: %s; retry %d in %.2fs", self.target, error.code().name, self.number, delay)
                self.number += 1
                return delay
        raise from_rpc_error(error) from None
