"""`start_cluster` without an address: a Ray instance of its own, serving over real gRPC."""

from __future__ import annotations

import pytest

from dspine import faults
from dspine.cluster.client import DSpineClient
from dspine.cluster.config import ClusterConfig
from dspine.cluster.launch import start_cluster
from dspine_testing.ray_cluster import free_port


def _serve_locally_and_generate(monkeypatch) -> int:
    """Start a cluster with no address while RAY_ADDRESS names a port nobody listens on; the
    tokens one request gets back through gRPC."""
    import ray
    from ray import serve

    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = ClusterConfig(grpc_port=free_port(), http_port=free_port(),
                           engine={"device": "cpu", "dtype": "float32", "max_concurrency": 2})
    for key in config.node_environment():  # start_cluster sets them in this process: undone after the test
        monkeypatch.delenv(key, raising=False)
    try:
        start_cluster(config)
        with DSpineClient(f"127.0.0.1:{config.grpc_port}") as client:
            return len(client.generate("def f(x):", max_new_tokens=4, timeout=60).token_ids)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_local_start_never_joins_the_cluster_ray_address_names(monkeypatch):
    """Ray's default (no address) joins whatever ``RAY_ADDRESS`` or the last ``ray start`` on the
    machine names: a developer's cluster, or one a test is stopping (a CI run beside another once
    errored every test of a module that way). ``dspine serve`` without ``--address`` must start
    its own instance and serve."""
    assert _serve_locally_and_generate(monkeypatch) == 4


@pytest.mark.timeout(240)
def test_joining_the_named_cluster_instead_fails_to_start(monkeypatch):
    """The same start with the fault that drops ``address="local"``: Ray takes the start for a join
    of the cluster RAY_ADDRESS names and refuses the local instance's CPU count."""
    with faults.inject("launch.local_start_joins_any_cluster"), pytest.raises(ValueError, match="existing cluster"):
        _serve_locally_and_generate(monkeypatch)
