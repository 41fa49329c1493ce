"""Standalone single-replica gRPC server: one engine behind ``grpc.aio``.

    config = ServerConfig(host="127.0.0.1", port=50051)
    asyncio.run(serve_forever(engine, config))        # until SIGINT / SIGTERM

Besides ``dspine.v1.DSpine`` it serves the standard ``grpc.health.v1.Health``
service (SERVING once started, NOT_SERVING from the start of a shutdown) and
server reflection. Options: message size limits, TLS (PEM cert + key paths),
and a bearer token checked on every call from the ``authorization`` metadata
(``Bearer <token>``; the health service is exempt so probes need no secret).

Graceful shutdown (:meth:`DSpineServer.stop`): health goes NOT_SERVING and new
generations are refused with UNAVAILABLE; in-flight generations run to the
end (up to ``grace`` seconds, then they are cancelled); then the gRPC server
stops and the engine shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import tracing
from .auth import bearer_token_matches
from .metrics import ServingMetrics, configure_metrics
from .grpc_adapter import DSpineServicer
from .registration import SERVICE_NAME, add_to_server
from .service import DSpineService
from .validation import ValidationLimits

logger = logging.getLogger(__name__)

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVING = health_pb2.HealthCheckResponse.SERVING


class ServerConfig(BaseModel):
    """Bootstrap options of the standalone server (the engine is configured separately)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="interface to bind; 0.0.0.0 for all")
    port: int = Field(50051, ge=0, le=65535, description="0 picks a free port (see DSpineServer.port)")
    max_receive_message_bytes: int = Field(4 * 1024 * 1024, ge=1024,
                                           description="larger requests get RESOURCE_EXHAUSTED")
    max_send_message_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    tls_cert: Path | None = Field(None, description="PEM certificate chain; with tls_key enables TLS")
    tls_key: Path | None = Field(None, description="PEM private key")
    auth_token: str | None = Field(None, min_length=1, description="bearer token every call must carry")
    shutdown_grace_s: float = Field(30.0, ge=0, description="how long in-flight streams may take to finish")
    model_name: str = Field("", description="reported by GetModelInfo")

    @model_validator(mode="after")
    def _tls_pair(self) -> "ServerConfig":
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert / tls_key: give both (TLS) or neither (plaintext)")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: no such file {path}")
        return self


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (UNAUTHENTICATED); health is exempt."""

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = (f"/{HEALTH_SERVICE_NAME}/",)):
        self._token = token
        self._exempt = exempt_prefixes

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        return details.method.startswith(self._exempt) or bearer_token_matches(details.invocation_metadata,
                                                                                 self._token)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if self._authorized(details):
            return handler
        # An unknown method is refused the same way: an unauthenticated caller does not learn
        # which method names exist (UNIMPLEMENTED would tell it).
        return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


def _deny(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts every call with ``code``."""

    async def reject(request_or_iterator, context):
        await context.abort(code, details)

    if handler is None:  # no such method: raw bytes in, nothing out
        return grpc.unary_unary_rpc_method_handler(reject)
    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(reject, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(reject, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(reject, **kwargs)
    return grpc.stream_stream_rpc_method_handler(reject, **kwargs)


class DSpineServer:
    """One engine behind a ``grpc.aio`` server; :meth:`start`, then :meth:`stop` (graceful)."""

    def __init__(self, engine, config: ServerConfig | None = None, limits: ValidationLimits | None = None,
                 metrics: ServingMetrics | None = None):
        self.engine = engine
        self._metrics = metrics
        self.config = config or ServerConfig()
        self._limits = limits
        self._server: grpc.aio.Server | None = None
        self.servicer: DSpineServicer | None = None
        self.health: health_aio.HealthServicer | None = None
        self.port: int | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Bind, start serving, mark SERVING; returns the bound port."""
        cfg = self.config
        interceptors = [BearerTokenInterceptor(cfg.auth_token)] if cfg.auth_token else []
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", cfg.max_receive_message_bytes),
            ("grpc.max_send_message_length", cfg.max_send_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
        tracing.configure("dspine-server")
        metrics = self._metrics
        if metrics is None and configure_metrics("dspine-server"):
            metrics = ServingMetrics(load=self.engine.load)
        self.servicer = DSpineServicer(DSpineService(self.engine, cfg.model_name, self._limits, metrics))
        add_to_server(self.servicer, server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert is not None:
            credentials = grpc.ssl_server_credentials([(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())])
            self.port = server.add_secure_port(address, credentials)
        else:
            self.port = server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"could not bind {address}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING)
        self._server = server
        self._stopped = asyncio.Event()
        logger.info("dspine server listening on %s (%s)", f"{cfg.host}:{self.port}",
                    "TLS" if cfg.tls_cert else "plaintext")
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new generations, drain, stop, shut the engine down."""
        if self._server is None:
            return
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        self.servicer.begin_drain()
        if not await self.servicer.wait_idle(grace):
            logger.warning("%d generations still running after %.1fs; cancelling them",
                           self.servicer.num_active, grace)
        await self._server.stop(grace=1.0)
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.engine.shutdown(drain=False, timeout=grace))
        self.servicer.service.close()
        self._server = None
        self._stopped.set()
        logger.info("dspine server stopped")

    async def wait_for_termination(self) -> None:
        if self._stopped is not None:
            await self._stopped.wait()


async def serve_forever(engine, config: ServerConfig, limits: ValidationLimits | None = None) -> None:
    """Run until SIGINT or SIGTERM, then shut down gracefully."""
    server = DSpineServer(engine, config, limits)
    await server.start()
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop_requested.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    print(f"dspine: serving on {server.address}", flush=True)
    await stop_requested.wait()
    await server.stop()
