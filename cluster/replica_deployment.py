"""The engine replica deployment: one engine per Ray Serve replica, a thin shim over DSpineService.

It speaks protos (the same :class:`DSpineService` the standalone server
uses) and raises the engine's typed errors; the ingress in front of it owns
gRPC statuses, retries and failover. Beyond the service methods it gives
Serve what a replica of a mature cluster must:

- ``record_routing_stats``: its load (in flight, free draft KV slots, live
  target states, recent acceptance) for :class:`~dspine.cluster.router.FreeCapacityRouter`;
- ``check_health``: probes the engine (device thread and loop alive, no
  stalled step); a failure makes Serve replace the replica;
- ``__del__``: called by Serve after its graceful drain (no new requests,
  in-flight ones finished or the drain timeout passed): stops the engine.

Nothing here touches tensors; the engine does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from pathlib import Path
from typing import AsyncIterator

from dspine.protos.dspine.v1 import dspine_pb2 as pb

from . import tracing
from .config import ClusterConfig
from .embedded import resolve_model_dirs, resolve_sampled_draft_dir
from .metrics import ServingMetrics, configure_metrics
from .service import DSpineService

logger = logging.getLogger(__name__)


def _replica_id() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests, benches)
        return None


def _engine_parent(carrier: dict | None):
    """Parent of the engine spans (None when nothing is traced): Serve's replica span when Ray
    tracing is on, else the ingress's span carried over the handle call."""
    return tracing.parent_context(carrier.items() if carrier else ()) if tracing.enabled() else None


class EngineReplica:
    """One engine and its :class:`DSpineService`; Serve calls these methods through the ingress."""

    def __init__(self, config: dict | ClusterConfig):
        from dspine.replica import Engine
        from dspine.replica.gc_freeze import freeze_after_load

        self.config = ClusterConfig.model_validate(config)
        model = self.config.model
        target_dir, draft_dir = resolve_model_dirs(model.target_dir, model.draft_dir, speculative_needed=False)
        sampled_draft_dir = resolve_sampled_draft_dir(model.target_dir, model.draft_dir, model.sampled_draft_dir)
        engine_config = self.config.engine.engine_config(self.config.replica_threads)
        self.engine = Engine.from_pretrained(target_dir, draft_dir, engine_config, sampled_draft_dir=sampled_draft_dir)
        freeze_after_load()  # this actor's process hosts this one engine (replica/gc_freeze.py)
        replica_id = _replica_id()
        tracing.configure("dspine-replica", replica_id=replica_id)
        metrics = (ServingMetrics(load=self.engine.load)
                   if configure_metrics("dspine-replica", replica_id=replica_id) else None)
        self.service = DSpineService(self.engine, model.name or Path(target_dir).name, metrics=metrics)
        logger.info("engine replica ready (pid %d, %s, max_concurrency %d, %d torch threads)", os.getpid(),
                    target_dir, engine_config.max_concurrency, self.config.replica_threads)

    # ------------------------------------------------------------ service
    async def generate(self, request: pb.GenerateRequest, trace_carrier: dict | None = None) -> pb.GenerateResponse:
        return await self.service.generate(request, _engine_parent(trace_carrier))

    async def generate_stream(self, request: pb.GenerateRequest, trace_carrier: dict | None = None
                              ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async for message in self.service.generate_stream(request, _engine_parent(trace_carrier)):
            yield message

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        return await self.service.tokenize(request)

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        return await self.service.detokenize(request)

    async def model_info(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:
        return await self.service.model_info(request)

    # ------------------------------------------------------------ control
    def load(self) -> dict:
        """The engine's load snapshot plus where this replica runs (pid, host)."""
        load = self.engine.load()
        return {**dataclasses.asdict(load), "free_slots": load.free_slots, "pid": os.getpid(),
                "host": socket.gethostname(), "healthy": self._health_error() is None}

    def record_routing_stats(self) -> dict:
        """Serve polls this (``request_routing_stats_period_s``) and hands it to the router."""
        return self.load()

    def _health_error(self) -> str | None:
        try:
            self.engine.check_health(self.config.replicas.stall_timeout_s)
        except RuntimeError as e:
            return str(e)
        return None

    def check_health(self) -> None:
        error = self._health_error()
        if error is not None:
            logger.error("engine replica unhealthy: %s", error)
            raise RuntimeError(error)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            # Serve has drained this replica already; whatever is left is cancelled.
            self.service.accepting = False
            engine.shutdown(drain=False, timeout=5.0)
            self.service.close()
