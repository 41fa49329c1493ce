"""``values.schema.json`` of the Helm chart, generated: its ``cluster`` part *is* ClusterConfig's schema.

    python -m dspine.cluster.helm_schema           # rewrite helm/dspine/values.schema.json (from the repo root)
    python -m dspine.cluster.helm_schema --check   # exit 1 when it is stale

The rest of the chart's values (image, models, head, worker, ...) is
described here; every object rejects unknown keys.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import ClusterConfig

# Relative to the repository root (the chart is not part of the installed package).
SCHEMA_PATH = Path("helm") / "dspine" / "values.schema.json"


def _object(properties: dict, required: tuple[str, ...] = ()) -> dict:
    schema = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_MAP = {"type": "object"}
_LIST = {"type": "array"}
_PLACEMENT = {"nodeSelector": {"type": "object", "additionalProperties": _STR}, "tolerations": _LIST,
              "affinity": _MAP}
_RESOURCES = _object({"requests": _MAP, "limits": _MAP})


def values_schema() -> dict:
    cluster = ClusterConfig.model_json_schema()
    definitions = cluster.pop("$defs", {})
    cluster.pop("title", None)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "dspine chart values",
        "$defs": definitions,
        **_object({
            "nameOverride": _STR,
            "fullnameOverride": _STR,
            "image": _object({"repository": {"type": "string", "minLength": 1}, "tag": _STR,
                              "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}},
                             required=("repository",)),
            "imagePullSecrets": _LIST,
            "rayVersion": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
            "cluster": cluster,
            "models": _object({
                "source": {"enum": ["pvc", "url"]},
                "mountPath": {"type": "string", "pattern": "^/"},
                "pvc": _object({"claimName": _STR, "subPath": _STR}),
                "url": _object({"target": _STR, "draft": _STR, "sampledDraft": _STR, "image": _STR,
                                "sizeLimit": _STR}),
            }),
            "head": _object({"resources": _RESOURCES, **_PLACEMENT}),
            "worker": _object({"gpusPerWorker": {"type": "integer", "minimum": 1, "maximum": 8},
                               "resources": _RESOURCES, **_PLACEMENT}),
            "rayAuth": _object({"enabled": _BOOL}),
            "auth": _object({"secretName": _STR, "secretKey": {"type": "string", "minLength": 1}}),
            "tracing": _object({"enabled": _BOOL, "otlpEndpoint": _STR, "serviceName": _STR,
                                "samplingRatio": {"type": "number", "minimum": 0, "maximum": 1}}),
            "grpcIngress": _object({"enabled": _BOOL, "className": _STR, "host": _STR, "tlsSecretName": _STR,
                                    "annotations": {"type": "object", "additionalProperties": _STR}}),
            "serviceMonitor": _object({"enabled": _BOOL, "interval": _STR,
                                       "labels": {"type": "object", "additionalProperties": _STR}}),
            "dashboard": _object({"enabled": _BOOL, "labels": {"type": "object", "additionalProperties": _STR}}),
        }, required=("image", "cluster")),
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--path", type=Path, default=SCHEMA_PATH, help="the chart's values.schema.json")
    args = parser.parse_args(argv)
    if args.check:
        stale = not args.path.exists() or args.path.read_text() != render()
        if stale:
            print(f"stale: {args.path} (run python -m dspine.cluster.helm_schema)", file=sys.stderr)
        return 1 if stale else 0
    args.path.write_text(render())
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
