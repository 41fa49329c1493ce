"""The asyncio face of the SDK: :class:`AsyncDSpineClient` and its :class:`AsyncGenerateStream`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import grpc.aio

from ..client_errors import Cancelled
from . import calls
from .core import ClientCore
from .results import GenerateChunk, GenerateResult, ModelInfo
from .spans import ClientSpan
from .streams import StreamCall


class AsyncGenerateStream:
    """Async iterator of :class:`GenerateChunk`; ``cancel()`` cancels the request (the next read
    raises :class:`Cancelled`); cancelling the task that reads it does the same."""

    def __init__(self, stream: StreamCall):
        self._stream = stream
        self._cancelled = False

    def __aiter__(self) -> "AsyncGenerateStream":
        return self

    async def __anext__(self) -> GenerateChunk:
        while True:
            try:
                message = await self._stream.call.read()
            except grpc.RpcError as e:
                await asyncio.sleep(self._stream.retry_delay(e))
                self._stream.restart()
                continue
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._cancelled and not (task is not None and getattr(task, "cancelling", lambda: 0)()):
                    # cancel() was called on this stream, not on the task reading it
                    raise Cancelled("the stream was cancelled by this client") from None
                self._stream.cancel("the reading task was cancelled")
                raise
            if message is grpc.aio.EOF:
                self._stream.finished()
                raise StopAsyncIteration
            return self._stream.message(message)

    def cancel(self) -> None:
        self._cancelled = True
        self._stream.cancel("the stream was cancelled by this client")

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "AsyncGenerateStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncDSpineClient(ClientCore):
    """asyncio client; same options and methods as :class:`DSpineClient`, as coroutines."""

    _channels = grpc.aio

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncDSpineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_ready(self, timeout: float | None = 10.0) -> None:
        """Wait until the channel connects (raises Unavailable on timeout)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise self._not_ready(timeout) from None

    async def _call(self, call: calls.UnaryCall, timeout: float | None, metadata: Sequence[tuple[str, str]] = ()):
        with ClientSpan(call.span) as span:
            for attempt in self._attempts(timeout, call.retried):
                with attempt:
                    return call.convert(await self._invoke(call, attempt, metadata, span))
                await asyncio.sleep(attempt.backoff)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       metadata: Sequence[tuple[str, str]] = (), **kwargs) -> GenerateResult:
        """Generate to completion (see the package docstring for the keywords)."""
        return await self._call(calls.generate(prompt, kwargs), timeout, metadata)

    def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None,
                        metadata: Sequence[tuple[str, str]] = (), **kwargs) -> AsyncGenerateStream:
        """Stream chunks as the server commits them (``async for``); the last carries finish_reason and stats."""
        return AsyncGenerateStream(self._stream(prompt, timeout, metadata, kwargs))

    async def tokenize(self, text: str | None = None, *, messages=None, add_special_tokens: bool | None = None,
                       timeout: float | None = None) -> list[int]:
        """Token ids of ``text``, or of chat ``messages`` rendered by the server's template."""
        return await self._call(calls.tokenize(text, messages, add_special_tokens), timeout)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                         timeout: float | None = None) -> str:
        """The text of ``token_ids``."""
        return await self._call(calls.detokenize(token_ids, skip_special_tokens), timeout)

    async def info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model's description and limits."""
        return await self._call(calls.info(), timeout)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name ("SERVING", "NOT_SERVING", ...)."""
        return await self._call(calls.health(service), timeout)
