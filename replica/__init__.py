"""The engine of ONE GPU: target + DSpine drafter, pools, verification, scheduler.

Nothing here imports Ray, gRPC or OpenTelemetry; the engine is a plain library::

    from dspine.replica import Engine, EngineConfig, SamplingParams
    engine = Engine.from_pretrained(target_dir, draft_dir, EngineConfig(max_concurrency=8))
    result = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=64))
"""

from .config import EngineConfig
from .engine import Engine, EngineLoad
from .errors import (
    DSpineError,
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
