"""The engine of ONE GPU: target + DSpine drafter, pools, verification, scheduler.

Nothing here imports Ray, gRPC or OpenTelemetry; the engine is a plain library::

    from dspine.replica import Engine, EngineConfig, SamplingParams
    engine = Engine.from_pretrained(target_dir, draft_dir, EngineConfig(max_concurrency=8))
    result = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=64))
"""

import importlib
from typing import TYPE_CHECKING

# Loaded on first use (PEP 562), so the torch-free modules of this package (errors,
# request_rules) import without torch: the gRPC edge and the client SDK use them.
_EXPORTS = {
    "EngineConfig": "config",
    "Engine": "engine",
    "EngineLoad": "engine",
    "DSpineError": "errors",
    "DrafterGeometryError": "errors",
    "EngineFullError": "errors",
    "EngineStoppedError": "errors",
    "InvalidRequestError": "errors",
    "NoDrafterError": "errors",
    "PoolExhaustedError": "errors",
    "RequestCancelledError": "errors",
    "RequestFailedError": "errors",
    "RequestTooLargeError": "errors",
    "MemoryPlanError": "memory_plan",
    "SamplingParams": "sampling",
    "GenerationResult": "types",
    "RequestStats": "types",
    "SpecDecodingStats": "types",
    "StreamChunk": "types",
}

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine import Engine, EngineLoad
    from .errors import (
        DSpineError,
        DrafterGeometryError,
        EngineFullError,
        EngineStoppedError,
        InvalidRequestError,
        NoDrafterError,
        PoolExhaustedError,
        RequestCancelledError,
        RequestFailedError,
        RequestTooLargeError,
    )
    from .memory_plan import MemoryPlanError
    from .sampling import SamplingParams
    from .types import GenerationResult, RequestStats, SpecDecodingStats, StreamChunk


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineLoad",
    "SamplingParams",
    "GenerationResult",
    "StreamChunk",
    "RequestStats",
    "SpecDecodingStats",
    "DSpineError",
    "DrafterGeometryError",
    "EngineFullError",
    "EngineStoppedError",
    "InvalidRequestError",
    "NoDrafterError",
    "RequestCancelledError",
    "RequestFailedError",
    "PoolExhaustedError",
    "RequestTooLargeError",
    "MemoryPlanError",
]
