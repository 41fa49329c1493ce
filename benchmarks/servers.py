"""The servers the cluster benches measure: the standalone gRPC server and a local Ray Serve cluster."""

from __future__ import annotations

import os
import subprocess
import sys


class StandaloneServer:
    """``dspine serve --standalone`` in a subprocess (its own process, as users run it)."""

    def __init__(self, threads: int, max_concurrency: int, target_dir=None, draft_dir=None, sampled_draft_dir=None):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        models = [*(["--target", str(target_dir)] if target_dir else []),
                  *(["--draft", str(draft_dir)] if draft_dir else []),
                  *(["--sampled-draft", str(sampled_draft_dir)] if sampled_draft_dir else [])]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dspine.cluster.cli", "serve", "--standalone", "--port", "0", "--device", "cpu",
             "--dtype", "float32", "--max-concurrency", str(max_concurrency), *models],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.proc.stdout.readline()
        if "serving on" not in line:
            self.proc.kill()
            raise RuntimeError(f"standalone server did not start: {line!r}")
        self.address = line.strip().rsplit(" ", 1)[-1]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class BenchCluster:
    """A local Ray instance with one dspine application per replica count."""

    def __init__(self, replica_counts: tuple[int, ...], threads: int, max_concurrency: int):
        import socket

        import ray
        from ray import serve

        from dspine.cluster.app import build_app
        from dspine.cluster.config import ClusterConfig

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        ray.init(address="local", num_cpus=max(8, 2 * sum(replica_counts) * threads), include_dashboard=False,
                 namespace="serve", log_to_driver=False, logging_level="ERROR")  # "local": never join another
        base = ClusterConfig(grpc_port=port)
        serve.start(grpc_options=base.grpc_options(), http_options={"host": "127.0.0.1", "port": 0},
                    logging_config={"log_level": "WARNING"})
        for count in replica_counts:
            config = ClusterConfig(app_name=f"r{count}", grpc_port=port,
                                   engine={"device": "cpu", "dtype": "float32", "max_concurrency": max_concurrency,
                                           "num_threads": threads},
                                   replicas={"num_replicas": count, "num_cpus": threads, "max_queued_requests": 64})
            serve.run(build_app(config), name=config.app_name, route_prefix="/" + config.app_name, blocking=False)
        direct = config.model_copy(update={"app_name": "direct"})
        options = direct.engine_deployment_options()
        options.update(num_replicas=1, name="DirectEngineReplica")
        options.pop("request_router_config")
        serve.run(serve.deployment(DirectEngineReplica, **options).bind(direct.model_dump(mode="json")),
                  name="direct", route_prefix="/direct", blocking=False)
        self.address = f"127.0.0.1:{port}"

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


class DirectEngineReplica:
    """Bench-only variant: Serve's proxy calls the engine replica directly (no ingress hop, so no
    admission, failover or status translation); measures what the ingress costs."""

    def __init__(self, config):
        from dspine.cluster.replica_deployment import EngineReplica

        self.replica = EngineReplica(config)

    async def GenerateStream(self, request, grpc_context):
        from dspine.cluster.errors import set_status
        from dspine.cluster.ingress import StreamFailed

        try:
            async for message in self.replica.generate_stream(request):
                yield message
        except Exception as e:  # noqa: BLE001
            set_status(grpc_context, e)
            raise StreamFailed(str(e)) from None
