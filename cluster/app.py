"""The Ray Serve application: ``build_app(args) -> Application``.

``serve run`` / ``serve deploy`` reach it by import path
(``dspine.cluster.app:build_app``); ``args`` is a :class:`ClusterConfig` as
a dict (the ``args:`` block of the serve config), validated strictly: an
unknown or misspelled key fails the deployment with the key's name.

Two deployments: :class:`DSpineIngress` (the gRPC methods) in front of
:class:`EngineReplica` (one engine each). Their Serve options come from the
config, so ``max_ongoing_requests`` of a replica is the engine's
``max_concurrency``.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from .config import ClusterConfig
from .ingress import DSpineIngress
from .replica_deployment import EngineReplica


def build_app(args: dict[str, Any] | ClusterConfig | None = None) -> Application:
    """The dspine.v1 cluster application for ``args`` (a :class:`ClusterConfig` or its dict)."""
    config = ClusterConfig.model_validate(args or {})
    plain = config.model_dump(mode="json")
    engines = serve.deployment(EngineReplica, **config.engine_deployment_options()).bind(plain)
    return serve.deployment(DSpineIngress, **config.ingress_deployment_options()).bind(engines, plain)
