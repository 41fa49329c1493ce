"""The strict serve-config check: the shipped file passes; every misspelled or conflicting key is named."""

from __future__ import annotations

import copy

import pytest
import yaml

from dspine.cluster.cli import main
from dspine.cluster.config import ClusterConfig
from dspine.cluster.serve_config import SHIPPED_CONFIG, check_serve_config, cluster_config_of


@pytest.fixture
def shipped():
    return yaml.safe_load(SHIPPED_CONFIG.read_text())


def test_shipped_config_is_valid_and_agrees_with_the_model(shipped):
    assert check_serve_config(shipped) == []
    config = cluster_config_of(shipped)
    # The document's own Serve options are exactly what the model derives (no drift).
    assert shipped["grpc_options"] == config.grpc_options()
    assert shipped["http_options"]["port"] == config.http_port
    assert config == ClusterConfig.model_validate(config.serve_config()["applications"][0]["args"])


def _mutated(doc, path, value):
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


@pytest.mark.parametrize("path, value, problem", [
    (("applications", 0, "deployments"), [{"name": "EngineReplica", "max_ongoing_request": 8}],
     "applications[0].deployments[0].max_ongoing_request: unknown key"),
    (("applications", 0, "deployments"), [{"name": "EngineReplica", "max_ongoing_requests": 16}],
     "applications[0].deployments[0].max_ongoing_requests: derived from args"),
    (("applications", 0, "deployments"), [{"name": "Engine", "num_replicas": 1}],
     "applications[0].deployments[0].name: 'Engine' is not a deployment"),
    (("applications", 0, "args", "replicas", "num_replica"), 2, "applications[0].args.replicas.num_replica"),
    (("applications", 0, "args", "engine", "max_concurrency"), 12, "applications[0].args.engine.max_concurrency"),
    (("applications", 0, "improt_path"), "x", "applications[0].improt_path: unknown key"),
    (("grpc_options", "prot"), 9000, "grpc_options.prot: unknown key"),
    (("grpc_options", "port"), 9001, "grpc_options.port: 9001 disagrees"),
    (("grpc_options", "grpc_servicer_functions"), [], "grpc_options.grpc_servicer_functions: must include"),
    (("proxy_locaton",), "EveryNode", "proxy_locaton: unknown key"),
])
def test_every_bad_key_is_named(shipped, path, value, problem):
    problems = check_serve_config(_mutated(shipped, path, value))
    assert any(p.startswith(problem) for p in problems), problems


def test_ray_schema_alone_would_accept_the_typo(shipped):
    from ray.serve.schema import ServeDeploySchema

    doc = _mutated(shipped, ("applications", 0, "deployments"), [{"name": "EngineReplica", "max_ongoing_request": 8}])
    ServeDeploySchema.model_validate(doc)  # silently drops it: why the strict check exists


def test_deploy_check_cli(tmp_path, shipped, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(shipped))
    assert main(["deploy", str(good), "--check"]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_mutated(shipped, ("applications", 0, "deployments"),
                                           [{"name": "EngineReplica", "max_ongoing_request": 8}])))
    capsys.readouterr()
    assert main(["deploy", str(bad), "--check"]) == 2
    assert "max_ongoing_request: unknown key" in capsys.readouterr().err
