"""The gRPC-facing deployment of the cluster: statuses, retries and failover in front of the engines.

Serve's gRPC proxy calls these methods by RPC name (``Generate``,
``GenerateStream``, ...). Each forwards the request through a
``DeploymentHandle`` to an :class:`~dspine.cluster.replica_deployment.EngineReplica`
(chosen by :class:`~dspine.cluster.router.FreeCapacityRouter`) and turns
every outcome into a gRPC status through the one table in
:mod:`dspine.cluster.errors`:

- an engine error (bad field, no drafter, ...) keeps its status;
- the engine deployment's queue is full (Serve's ``BackPressureError``) ->
  RESOURCE_EXHAUSTED;
- the replica died before the request emitted anything -> the request is sent
  once more (Serve routes it to a live replica), invisibly to the caller;
- the replica died after a stream emitted tokens -> UNAVAILABLE with a clear
  message (a stream cannot be resumed elsewhere: sampling state is gone).

Serve itself never retries a started request and reports a dead replica as
INTERNAL with a traceback, which is why this hop exists (the README's
architecture section gives its measured cost). A cancelled call (client
cancel, deadline, ``request_timeout_s``) cancels the engine request, queued
or running, so its slot is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from dspine.protos.dspine.v1 import dspine_pb2 as pb

from . import tracing
from .admission import Admission
from .auth import bearer_token_matches
from .metrics import ServingMetrics, configure_metrics
from .config import ENGINE_DEPLOYMENT, ClusterConfig
from .errors import ClusterBusyError, ReplicaLostError, UnauthenticatedError, set_status

logger = logging.getLogger(__name__)


class StreamFailed(Exception):
    """Ends a stream whose status is already set on its grpc_context."""


def check_bearer(metadata, expected_token: str | None) -> None:
    """Raise :class:`UnauthenticatedError` unless ``metadata`` carries ``authorization: Bearer <token>``
    (a no-op when no token is configured). Constant-time comparison."""
    if not expected_token or bearer_token_matches(metadata, expected_token):
        return
    raise UnauthenticatedError("missing or invalid bearer token (authorization: Bearer <token>)")


def _translate(exc: BaseException) -> BaseException:
    """Ray's exceptions as the cluster's typed errors; an engine error raised in a replica
    arrives wrapped in ``RayTaskError`` (its text is a traceback) and is unwrapped."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, Exception):
        return exc.cause
    if isinstance(exc, BackPressureError):
        return ClusterBusyError(f"cluster is full: every replica slot and queue place is taken; retry later "
                                f"({exc})")
    return exc


class DSpineIngress:
    """dspine.v1 over Serve's gRPC proxy, forwarding to the engine replicas."""

    def __init__(self, engine_handle, config: dict | ClusterConfig):
        self.config = ClusterConfig.model_validate(config)
        self.engines = engine_handle
        self.retry_unstarted = self.config.ingress.retry_unstarted
        token_env = self.config.ingress.auth_token_env
        self.auth_token = os.environ.get(token_env) if token_env else None
        if token_env and not self.auth_token:
            raise RuntimeError(f"ingress.auth_token_env: the environment variable {token_env} is empty or unset")
        self.live_engine_replicas = self.config.initial_engine_replicas
        self.admission = Admission(self.config.engine.max_concurrency, self.config.replicas.max_queued_requests,
                                   lambda: self.live_engine_replicas)
        self._watcher: asyncio.Task | None = None
        tracing.configure("dspine-ingress")
        # Requests by final status, counted where every outcome is known (admission refusals too).
        self.metrics = ServingMetrics() if configure_metrics("dspine-ingress") else None

    # ------------------------------------------------------- replica count
    def _watch_replicas(self) -> None:
        """Keep ``live_engine_replicas`` current (started on the first request, on Serve's loop)."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _watch_loop(self, period_s: float = 1.0) -> None:
        from ray import serve

        app_name = serve.get_replica_context().app_name
        while True:
            try:
                status = await asyncio.to_thread(serve.status)
                deployment = status.applications[app_name].deployments[ENGINE_DEPLOYMENT]
                self.live_engine_replicas = int(deployment.replica_states.get("RUNNING", 0))
                self.admission.fill()  # more replicas: hand their slots to waiting requests
            except Exception:  # noqa: BLE001 - keep the last count; the controller may be restarting
                logger.debug("could not read the engine replica count", exc_info=True)
            await asyncio.sleep(period_s)

    def _span(self, rpc: str, request, grpc_context) -> tracing.RequestSpan:
        """The RPC's span: under Serve's replica span when Ray tracing is on, else continuing the
        caller's W3C context from the metadata."""
        parent = tracing.parent_context(grpc_context.invocation_metadata())
        return tracing.RequestSpan(rpc, request, self.config.model.name or "dspine", parent)

    async def _unary(self, method: str, request, grpc_context, response_type, rpc: str = ""):
        """Forward a unary call; on failure set the status and return an empty ``response_type``
        (Serve serializes whatever is returned, and keeps the status set here)."""
        self._watch_replicas()
        start = time.perf_counter()
        span = self._span(rpc or method, request, grpc_context) if method == "generate" else None
        cancelled = False
        try:
            check_bearer(grpc_context.invocation_metadata(), self.auth_token)
            async with self.admission.admit():
                return await self._forward_unary(method, request, grpc_context, response_type, span)
        except (ClusterBusyError, UnauthenticatedError) as e:
            set_status(grpc_context, e)
            return response_type()
        except asyncio.CancelledError:  # client cancel, deadline, request_timeout_s
            cancelled = True
            raise
        finally:
            code = grpc_context.code()
            code_name = "CANCELLED" if cancelled else (code.name if code else "OK")
            if span is not None:
                span.finish(code_name, grpc_context.details() if code else None)
            if self.metrics is not None and method == "generate":
                self.metrics.record_status(code_name, time.perf_counter() - start)

    async def _forward_unary(self, method: str, request, grpc_context, response_type, span=None):
        attempts = 2 if self.retry_unstarted else 1
        args = (request, tracing.carrier_of(span.context)) if span is not None and span.span is not None else (request,)
        for attempt in range(1, attempts + 1):
            with span.activate() if span is not None else contextlib.nullcontext():
                response = getattr(self.engines, method).remote(*args)
            try:
                return await response
            except RayActorError as e:
                if attempt < attempts:
                    logger.warning("%s: replica lost before replying; retrying once on another replica", method)
                    continue
                set_status(grpc_context, ReplicaLostError(
                    f"the replica serving this request died before it replied ({type(e).__name__}); "
                    "send the request again"))
            except Exception as e:  # noqa: BLE001 - every error becomes a status, in errors.py
                set_status(grpc_context, _translate(e))
            finally:
                response.cancel()  # no-op when done; frees the slot when this call was cancelled
            return response_type()
        return response_type()

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:
        return await self._unary("generate", request, grpc_context, pb.GenerateResponse, "Generate")

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context) -> AsyncIterator[pb.GenerateStreamResponse]:
        self._watch_replicas()
        start = time.perf_counter()
        span = self._span("GenerateStream", request, grpc_context)
        code, error = "OK", None
        try:
            check_bearer(grpc_context.invocation_metadata(), self.auth_token)
            async with self.admission.admit():
                async with contextlib.aclosing(self._forward_stream(request, grpc_context, span)) as messages:
                    async for message in messages:
                        yield message
        except (ClusterBusyError, UnauthenticatedError) as e:
            code = set_status(grpc_context, e).name
            error = str(e)
            raise StreamFailed(str(e)) from None
        except StreamFailed as e:
            code, error = (grpc_context.code().name if grpc_context.code() else "UNKNOWN"), str(e)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code, error = "CANCELLED", "the call was cancelled"
            raise
        finally:
            span.finish(code, error)
            if self.metrics is not None:
                self.metrics.record_status(code, time.perf_counter() - start)

    async def _forward_stream(self, request: pb.GenerateRequest, grpc_context, span=None
                              ) -> AsyncIterator[pb.GenerateStreamResponse]:
        # Serve copies a stream's grpc_context to the call only with each message, so a status
        # set after the last one must travel as an exception (Serve keeps the code set here).
        # Trailing metadata does not travel that way: the field is the details' prefix.
        attempts = 2 if self.retry_unstarted else 1
        sent = 0
        for attempt in range(1, attempts + 1):
            carrier = tracing.carrier_of(span.context) if span is not None and span.span is not None else None
            with span.activate() if span is not None else contextlib.nullcontext():
                stream = self.engines.options(stream=True).generate_stream.remote(request, carrier)
            try:
                async for message in stream:
                    sent += 1
                    yield message
                return
            except RayActorError:
                if sent == 0 and attempt < attempts:
                    logger.warning("GenerateStream: replica lost before the first token; retrying once elsewhere")
                    continue
                error: BaseException = ReplicaLostError(
                    f"the replica serving this stream died after {sent} messages were sent; the stream cannot "
                    "be resumed, send the request again" if sent else
                    "the replica serving this stream died before it started; send the request again")
            except Exception as e:  # noqa: BLE001
                error = _translate(e)
            finally:
                stream.cancel()
            set_status(grpc_context, error)
            raise StreamFailed(str(error)) from None

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context) -> pb.TokenizeResponse:
        return await self._unary("tokenize", request, grpc_context, pb.TokenizeResponse)

    async def Detokenize(self, request: pb.DetokenizeRequest, grpc_context) -> pb.DetokenizeResponse:
        return await self._unary("detokenize", request, grpc_context, pb.DetokenizeResponse)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context) -> pb.ModelInfo:
        return await self._unary("model_info", request, grpc_context, pb.ModelInfo)
