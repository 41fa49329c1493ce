"""Serve-config files (``serve deploy`` / ``serve run``): the shipped one and a strict check.

Ray's own schema drops keys it does not know without a word: a deployment
override ``max_ongoing_request: 8`` validates and the default (5) applies.
:func:`check_serve_config` rejects every key that no schema level knows, with
its path, validates our application's ``args`` as a :class:`ClusterConfig`
(extra keys forbidden), refuses a deployment override that would make Serve
and the engine disagree (``max_ongoing_requests`` of the engine replicas is
``engine.max_concurrency``), then runs Ray's own validation for the values.

    problems = check_serve_config(yaml.safe_load(open("serve_config.yaml")))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .config import APP_IMPORT_PATH, ENGINE_DEPLOYMENT, GRPC_SERVICER_FUNCTION, INGRESS_DEPLOYMENT, ClusterConfig

SHIPPED_CONFIG = Path(__file__).resolve().parent / "serve_config.yaml"

# Options of the engine replicas that ClusterConfig derives; an override would split their source.
_DERIVED_ENGINE_OPTIONS = ("max_ongoing_requests", "request_router_config")


def _known_keys(model: type[BaseModel]) -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(name)
        if field.alias:
            keys.add(field.alias)
    return keys


def _unknown(doc: Any, model: type[BaseModel], path: str) -> list[str]:
    if not isinstance(doc, dict):
        return [f"{path}: must be a mapping, got {type(doc).__name__}"]
    known = _known_keys(model)
    return [f"{path}.{key}: unknown key (not a field of {model.__name__})" if path else
            f"{key}: unknown key (not a field of {model.__name__})"
            for key in doc if key not in known]


def _pydantic_problems(e: ValidationError, prefix: str) -> list[str]:
    problems = []
    for error in e.errors():
        loc = ".".join(str(part) for part in error["loc"])
        problems.append(f"{prefix}{loc}: {error['msg']}")
    return problems


def check_serve_config(doc: Any) -> list[str]:
    """Every problem of a serve-config document, each starting with its key path (empty: valid)."""
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
        gRPCOptionsSchema,
    )

    problems = _unknown(doc, ServeDeploySchema, "")
    if problems and not isinstance(doc, dict):
        return problems
    for key, schema in (("grpc_options", gRPCOptionsSchema), ("http_options", HTTPOptionsSchema)):
        if doc.get(key) is not None:
            problems += _unknown(doc[key], schema, key)
    grpc_functions = (doc.get("grpc_options") or {}).get("grpc_servicer_functions") or []
    applications = doc.get("applications") or []
    ours = [a for a in applications if isinstance(a, dict) and a.get("import_path") == APP_IMPORT_PATH]
    if ours and GRPC_SERVICER_FUNCTION not in grpc_functions:
        problems.append(f"grpc_options.grpc_servicer_functions: must include {GRPC_SERVICER_FUNCTION} "
                        "(else the gRPC proxy does not serve dspine.v1)")
    for i, app in enumerate(applications):
        where = f"applications[{i}]"
        problems += _unknown(app, ServeApplicationSchema, where)
        if not isinstance(app, dict):
            continue
        config: ClusterConfig | None = None
        if app.get("import_path") == APP_IMPORT_PATH:
            try:
                config = ClusterConfig.model_validate(app.get("args") or {})
            except ValidationError as e:
                problems += _pydantic_problems(e, f"{where}.args.")
        if config is not None:
            given = doc.get("grpc_options") or {}
            for key, value in config.grpc_options().items():
                if key != "grpc_servicer_functions" and given.get(key) != value:
                    problems.append(f"grpc_options.{key}: {given.get(key)!r} disagrees with {where}.args "
                                    f"({value!r}); keep them equal")
        for j, deployment in enumerate(app.get("deployments") or []):
            dwhere = f"{where}.deployments[{j}]"
            problems += _unknown(deployment, DeploymentSchema, dwhere)
            if not isinstance(deployment, dict) or app.get("import_path") != APP_IMPORT_PATH:
                continue
            name = deployment.get("name")
            if name not in (ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT):
                problems.append(f"{dwhere}.name: {name!r} is not a deployment of this application "
                                f"({ENGINE_DEPLOYMENT}, {INGRESS_DEPLOYMENT})")
            if name == ENGINE_DEPLOYMENT:
                for option in _DERIVED_ENGINE_OPTIONS:
                    if option in deployment:
                        problems.append(f"{dwhere}.{option}: derived from args (engine.max_concurrency, "
                                        "replicas.*); set it there, not here")
    if not problems:
        try:
            ServeDeploySchema.model_validate(doc)
        except ValidationError as e:
            problems += _pydantic_problems(e, "")
    return problems


def load_serve_config(path: str | Path) -> dict:
    """Read a serve-config YAML and check it strictly; raises ``ValueError`` listing every problem."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    problems = check_serve_config(doc)
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return doc


def cluster_config_of(doc: dict, app_name: str | None = None) -> ClusterConfig:
    """The :class:`ClusterConfig` of the (named, else first) dspine application in a serve config."""
    for app in doc.get("applications") or []:
        if app.get("import_path") == APP_IMPORT_PATH and app_name in (None, app.get("name")):
            return ClusterConfig.model_validate(app.get("args") or {})
    raise ValueError(f"no application with import_path {APP_IMPORT_PATH}" + (f" named {app_name}" if app_name else ""))
