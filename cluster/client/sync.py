"""The blocking face of the SDK: :class:`DSpineClient` and its :class:`GenerateStream`."""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from . import calls
from .core import ClientCore
from .results import GenerateChunk, GenerateResult, ModelInfo
from .spans import ClientSpan
from .streams import StreamCall


class GenerateStream:
    """Iterator of :class:`GenerateChunk`; ``cancel()`` (or leaving ``with``) cancels the request."""

    def __init__(self, stream: StreamCall):
        self._stream = stream

    def __iter__(self) -> "GenerateStream":
        return self

    def __next__(self) -> GenerateChunk:
        while True:
            try:
                return self._stream.message(next(self._stream.call))
            except StopIteration:
                self._stream.finished()
                raise
            except grpc.RpcError as e:
                time.sleep(self._stream.retry_delay(e))
                self._stream.restart()

    def cancel(self) -> None:
        self._stream.cancel("the stream was cancelled by this client")

    close = cancel

    def __enter__(self) -> "GenerateStream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class DSpineClient(ClientCore):
    """Blocking client. Keyword options: ``token``, ``tls``, ``root_certificates``,
    ``tls_server_name``, ``timeout`` (default per-call deadline), ``retry`` (:class:`RetryPolicy`),
    ``max_message_bytes``, ``options``, ``application``."""

    _channels = grpc

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "DSpineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float | None = 10.0) -> None:
        """Block until the channel connects (raises Unavailable on timeout)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise self._not_ready(timeout) from None

    def _call(self, call: calls.UnaryCall, timeout: float | None, metadata: Sequence[tuple[str, str]] = ()):
        with ClientSpan(call.span) as span:
            for attempt in self._attempts(timeout, call.retried):
                with attempt:
                    return call.convert(self._invoke(call, attempt, metadata, span))
                time.sleep(attempt.backoff)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **kwargs) -> GenerateResult:
        """Generate to completion (see the package docstring for the keywords)."""
        return self._call(calls.generate(prompt, kwargs), timeout, metadata)

    def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None,
                        metadata: Sequence[tuple[str, str]] = (), **kwargs) -> GenerateStream:
        """Stream chunks as the server commits them; the last carries finish_reason and stats."""
        return GenerateStream(self._stream(prompt, timeout, metadata, kwargs))

    def tokenize(self, text: str | None = None, *, messages=None, add_special_tokens: bool | None = None,
                 timeout: float | None = None) -> list[int]:
        """Token ids of ``text``, or of chat ``messages`` rendered by the server's template."""
        return self._call(calls.tokenize(text, messages, add_special_tokens), timeout)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   timeout: float | None = None) -> str:
        """The text of ``token_ids``."""
        return self._call(calls.detokenize(token_ids, skip_special_tokens), timeout)

    def info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model's description and limits."""
        return self._call(calls.info(), timeout)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name ("SERVING", "NOT_SERVING", ...)."""
        return self._call(calls.health(service), timeout)
