"""A real local Ray cluster with Serve's gRPC proxy, for end-to-end tests.

One Ray instance per test module (starting Ray costs ~10 s): ``LocalCluster``
starts it, ``deploy(name, config)`` adds a dspine application (several may
run side by side; clients then name theirs with ``application=``), and
``loads(name)`` reads every engine replica's own load report (in flight,
high-water mark, live states, pid), the same report the router gets.
"""

from __future__ import annotations

import os
import socket

from dspine.cluster.config import ClusterConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


from .waiting import wait_until as wait_for  # noqa: E402,F401 - cluster tests poll with it


class LocalCluster:
    """``ray.init`` + ``serve.start`` on free ports; ``close()`` shuts both down."""

    def __init__(self, num_cpus: int = 8, max_message_bytes: int = 4 * 1024 * 1024,
                 request_timeout_s: float = 120.0):
        import ray
        from ray import serve

        self.grpc_port = free_port()
        self.http_port = free_port()
        self.request_timeout_s = request_timeout_s
        self.max_message_bytes = max_message_bytes
        # Serve's proxy reads its message limit from the environment of the node.
        os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(max_message_bytes)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # "local": never join a cluster that RAY_ADDRESS or a `ray start` elsewhere on this machine
        # names (a test's `ray start --head` being stopped made every test of the next module error)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace="serve",
                 log_to_driver=False)
        base = self.config()
        serve.start(grpc_options=base.grpc_options(), http_options={"host": "127.0.0.1", "port": self.http_port})
        self.address = f"127.0.0.1:{self.grpc_port}"

    def config(self, **fields) -> ClusterConfig:
        """A ClusterConfig on this cluster's ports (fields as ClusterConfig takes them)."""
        return ClusterConfig.model_validate({"grpc_port": self.grpc_port, "http_port": self.http_port,
                                             "request_timeout_s": self.request_timeout_s,
                                             "max_message_bytes": self.max_message_bytes, **fields})

    def deploy(self, config: ClusterConfig) -> None:
        from ray import serve

        from dspine.cluster.app import build_app

        serve.run(build_app(config), name=config.app_name, route_prefix="/" + config.app_name, blocking=False)

    def loads(self, app_name: str) -> list[dict]:
        from dspine.cluster.launch import replica_loads

        return replica_loads(app_name)

    def idle(self, app_name: str) -> bool:
        """Every live replica of the app holds nothing: no request, no target state, no draft slot."""
        loads = self.loads(app_name)
        return bool(loads) and all(
            "error" not in r and r["in_flight"] == 0 and r["live_target_states"] == 0
            and r["free_draft_slots"] == r["draft_slots"] for r in loads)

    def close(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
