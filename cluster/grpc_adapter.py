"""The ``grpc.aio`` adapter of :class:`~dspine.cluster.service.DSpineService`: statuses and drain tracking.

Every method goes through :meth:`DSpineServicer._answering`, the one place where
an exception becomes a status (through :mod:`dspine.cluster.errors`), where a
generation's span (continuing the caller's W3C context) and status metric are
recorded, and where in-flight generations are counted so that a server can
drain them (:meth:`DSpineServicer.begin_drain`, :meth:`DSpineServicer.wait_idle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from dspine.protos.dspine.v1 import dspine_pb2_grpc as pb_grpc

from . import tracing
from .errors import abort, describe
from .service import DSpineService

__all__ = ["DSpineServicer"]

_GENERATIONS = ("Generate", "GenerateStream")  # traced, metered and drained


class DSpineServicer(pb_grpc.DSpineServicer):
    """``grpc.aio`` adapter of :class:`DSpineService`: status mapping and drain tracking."""

    def __init__(self, service: DSpineService):
        self.service = service
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_active(self) -> int:
        """Generate / GenerateStream calls in progress."""
        return self._active

    def begin_drain(self) -> None:
        """Refuse new generations (UNAVAILABLE); the ones in flight go on."""
        self.service.accepting = False

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no generation is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    @contextlib.contextmanager
    def _tracked(self, rpc: str):
        if rpc not in _GENERATIONS:
            yield
            return
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def _answering(self, rpc: str, request, context):
        """Run one call: any exception aborts it with its status; a generation also gets its span
        (yielded: its context parents the engine's stage spans; None for other methods) and metric."""
        traced = rpc in _GENERATIONS
        span = (tracing.RequestSpan(rpc, request, self.service.model_name,
                                    tracing.context_from_metadata(context.invocation_metadata()))
                if traced else None)
        start = time.perf_counter()
        code, error = "OK", None
        with self._tracked(rpc):
            try:
                yield span
            except asyncio.CancelledError:
                code, error = "CANCELLED", "the call was cancelled"
                raise
            except Exception as e:  # noqa: BLE001 - mapped to a status here, in errors.py
                described = describe(e)  # once: an unexpected error is logged with its traceback once
                code, error = described[0].name, described[1]
                await abort(context, e, described)
            finally:
                if traced:
                    span.finish(code, error)
                    if self.service.metrics is not None:
                        self.service.metrics.record_status(code, time.perf_counter() - start)

    async def Generate(self, request, context):
        async with self._answering("Generate", request, context) as span:
            return await self.service.generate(request, span.context)

    async def GenerateStream(self, request, context):
        async with self._answering("GenerateStream", request, context) as span:
            async with contextlib.aclosing(self.service.generate_stream(request, span.context)) as messages:
                async for message in messages:
                    await context.write(message)

    async def Tokenize(self, request, context):
        async with self._answering("Tokenize", request, context):
            return await self.service.tokenize(request)

    async def Detokenize(self, request, context):
        async with self._answering("Detokenize", request, context):
            return await self.service.detokenize(request)

    async def GetModelInfo(self, request, context):
        async with self._answering("GetModelInfo", request, context):
            return await self.service.model_info(request)
