"""What a generate stream's sync and asyncio faces share: its call, retry rule, span, conversion.

A stream is retried only if UNAVAILABLE (or another of the policy's codes) arrives before its first
message: after one, the server has generated tokens the caller has seen, and a second call would
not continue them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from ..client_errors import Cancelled, DSpineClientError, from_rpc_error
from .results import GenerateChunk, chunk_of
from .retry import Attempts
from .spans import ClientSpan


class StreamCall:
    """One GenerateStream request over its tries; ``call`` is the gRPC call of the try under way."""

    def __init__(self, start: Callable[[float | None], Any], attempts: Attempts, span: ClientSpan):
        self._start, self._attempts, self._span = start, attempts, span
        self._received = False
        self.call = start(attempts.deadline.remaining())

    def message(self, message) -> GenerateChunk:
        """A message read from ``call``, as the SDK returns it."""
        self._received = True
        return chunk_of(message)

    def retry_delay(self, error: grpc.RpcError) -> float:
        """Seconds to wait before :meth:`restart` after a failed read; raises ``error`` as its typed
        client error (and ends the span) when the stream may not be tried again."""
        try:
            if self._received:
                raise from_rpc_error(error)
            return self._attempts.backoff_after(error)
        except DSpineClientError as typed:
            self._span.end(typed)
            raise typed from None

    def restart(self) -> None:
        self.call = self._start(self._attempts.deadline.remaining())

    def finished(self) -> None:
        """The server ended the stream: end the span as a success."""
        self._span.end()

    def cancel(self, why: str) -> None:
        """Cancel the request on the server; the span ends as cancelled (``why``)."""
        self.call.cancel()
        self._span.end(Cancelled(why))
