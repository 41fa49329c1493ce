"""Start the cluster (``dspine serve``), read its state (``dspine status``), deploy a config (``dspine deploy``).

``start_cluster`` starts a local Ray instance (or joins one at ``address``),
starts Serve with the config's gRPC options and deploys the application.
``replica_loads`` asks every live engine replica for its load report (the
same dict the router gets), through the replica actors' routing-stats call.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from dspine import faults

from .config import ENGINE_DEPLOYMENT, ClusterConfig

SERVE_NAMESPACE = "serve"
_AUTH_TOKEN = Path.home() / ".ray" / "auth_token"


def use_ray_token_auth() -> None:
    """``ray start`` turns token auth on by default (Ray 2.60); the Serve CLI and drivers then
    need ``RAY_AUTH_MODE=token`` to read ``~/.ray/auth_token``."""
    if "RAY_AUTH_MODE" not in os.environ and _AUTH_TOKEN.exists():
        os.environ["RAY_AUTH_MODE"] = "token"


def local_num_cpus(config: ClusterConfig) -> int:
    """Logical CPUs for a local Ray instance: what the deployments reserve, at least the machine's."""
    needed = (config.max_engine_replicas * config.replicas.num_cpus
              + config.ingress.num_replicas * config.ingress.num_cpus)
    return max(os.cpu_count() or 1, math.ceil(needed + 0.5))


def start_cluster(config: ClusterConfig, address: str | None = None) -> None:
    """Start or join Ray, start Serve with the gRPC proxy, deploy the application."""
    import ray
    from ray import serve

    from .app import build_app

    for key, value in config.node_environment().items():
        os.environ.setdefault(key, value)  # a local Ray instance's processes inherit it
    if address:
        use_ray_token_auth()
        ray.init(address=address, namespace=SERVE_NAMESPACE, log_to_driver=False)
    else:
        # "local": a new instance of our own. Without an address ray.init joins whatever RAY_ADDRESS or
        # the last `ray start` on this machine names (a developer's cluster, or one being stopped).
        local = None if faults.active("launch.local_start_joins_any_cluster") else "local"
        ray.init(address=local, num_cpus=local_num_cpus(config), namespace=SERVE_NAMESPACE,
                 include_dashboard=False, log_to_driver=False)
    serve.start(grpc_options=config.grpc_options(), http_options={"host": "0.0.0.0", "port": config.http_port})
    # Returns once every replica is up (blocking=False only means: do not loop forever here).
    serve.run(build_app(config), name=config.app_name, route_prefix="/" + config.app_name, blocking=False)


def engine_replica_actors(app_name: str) -> list[tuple[str, object]]:
    """``(name, actor handle)`` of every live engine replica of ``app_name`` (needs ``ray.init``)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{ENGINE_DEPLOYMENT}#"
    actors = []
    for entry in ray.util.list_named_actors(all_namespaces=True):  # [{"name": ..., "namespace": ...}]
        if entry["name"].startswith(prefix):
            try:
                actors.append((entry["name"][len(prefix):], ray.get_actor(entry["name"], namespace=entry["namespace"])))
            except ValueError:  # died between the listing and the lookup
                continue
    return actors


def replica_loads(app_name: str, timeout_s: float = 5.0) -> list[dict]:
    """The load report of every live engine replica (``replica`` = its Serve id); unreachable
    replicas appear with ``error``."""
    import ray

    reports = []
    for replica_id, actor in engine_replica_actors(app_name):
        try:
            report = ray.get(actor.record_routing_stats.remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - a dying replica is part of the status
            report = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
        reports.append({"replica": replica_id, **report})
    return sorted(reports, key=lambda r: r["replica"])


def _free_tokens(report: dict) -> str:
    """Free (unreserved) tokens per pool of a load report; "-" for an unbounded or absent pool."""
    def one(key):
        value = report.get(key)
        return "-" if value is None else f"{value:,}"
    return f"{one('free_target_tokens')}/{one('free_draft_tokens')}"


def format_status(app_name: str, app_status: str, loads: list[dict]) -> str:
    lines = [f"application {app_name}: {app_status}", f"{'replica':<12} {'pid':>7} {'in flight':>9} "
             f"{'peak':>5} {'free draft slots':>16} {'free tokens (target/draft)':>26} {'accepted':>8} "
             f"{'finished':>8}  health"]
    for r in loads:
        if "error" in r:
            lines.append(f"{r['replica']:<12} unreachable: {r['error']}")
            continue
        lines.append(f"{r['replica']:<12} {r['pid']:>7} {r['in_flight']:>4}/{r['max_concurrency']:<4} "
                     f"{r['peak_in_flight']:>5} {r['free_draft_slots']:>16} {_free_tokens(r):>26} "
                     f"{r['recent_accepted_len']:>8.2f} "
                     f"{r['num_finished']:>8}  {'healthy' if r['healthy'] else 'UNHEALTHY'}")
    return "\n".join(lines)


def serve_deploy(config_path: str, address: str | None) -> int:
    """Run ``serve deploy`` on a checked config (with Ray's token auth when the cluster uses it)."""
    use_ray_token_auth()
    serve_cli = Path(sys.executable).with_name("serve")
    command = [str(serve_cli) if serve_cli.exists() else "serve", "deploy", str(config_path)]
    if address:
        command += ["--address", address]
    return subprocess.call(command)
