"""ClusterConfig: one source for every setting that Serve and the engine must agree on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dspine.cluster.config import ENGINE_DEPLOYMENT, GRPC_SERVICER_FUNCTION, ClusterConfig


@pytest.mark.parametrize("max_concurrency", [1, 3, 8])
def test_replica_cap_is_the_engines_cap(max_concurrency):
    config = ClusterConfig(engine={"max_concurrency": max_concurrency})
    options = config.engine_deployment_options()
    assert options["max_ongoing_requests"] == max_concurrency
    assert config.engine.engine_config(config.replica_threads).max_concurrency == max_concurrency
    assert options["name"] == ENGINE_DEPLOYMENT


def test_cap_above_eight_is_rejected():
    with pytest.raises(ValidationError, match="max_concurrency"):
        ClusterConfig(engine={"max_concurrency": 9})


def test_unknown_keys_are_rejected_with_their_path():
    with pytest.raises(ValidationError) as info:
        ClusterConfig.model_validate({"replicas": {"num_replica": 2}})
    assert info.value.errors()[0]["loc"] == ("replicas", "num_replica")


def test_gpu_replica_options_and_cpu_threads():
    gpu = ClusterConfig(replicas={"num_gpus": 1, "num_cpus": 4})
    actor = gpu.engine_deployment_options()["ray_actor_options"]
    assert (actor["num_cpus"], actor["num_gpus"]) == (4, 1)
    assert gpu.replica_threads == 4
    assert ClusterConfig(replicas={"num_cpus": 0.5}).replica_threads == 1
    assert ClusterConfig(engine={"num_threads": 3}).engine.engine_config(1).num_threads == 3


def test_autoscaling_replaces_num_replicas_and_bounds_its_target():
    config = ClusterConfig(replicas={"autoscaling": {"min_replicas": 1, "max_replicas": 3}})
    options = config.engine_deployment_options()
    assert "num_replicas" not in options and options["autoscaling_config"]["max_replicas"] == 3
    with pytest.raises(ValidationError, match="target_ongoing_requests"):
        ClusterConfig(engine={"max_concurrency": 4}, replicas={"autoscaling": {"target_ongoing_requests": 6}})


def test_serve_queue_is_a_backstop_above_the_ingress_bound():
    config = ClusterConfig(replicas={"num_replicas": 2, "max_queued_requests": 5})
    assert config.engine_deployment_options()["max_queued_requests"] == 5 + 2 * 8
    assert config.ingress_deployment_options()["max_ongoing_requests"] >= 2 * 8 + 5


def test_serve_config_document_round_trips():
    config = ClusterConfig(grpc_port=9100, replicas={"num_replicas": 3})
    doc = config.serve_config()
    assert doc["grpc_options"]["port"] == 9100
    assert doc["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER_FUNCTION]
    assert ClusterConfig.model_validate(doc["applications"][0]["args"]) == config
