"""The SDK's unary RPCs as data: which stub method, its request, how to read its response.

Both clients run a :class:`UnaryCall` the same way (``_call``: retries, deadline, span,
metadata); only the calling and the sleeping differ between them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dspine.protos.dspine.v1 import dspine_pb2 as pb

from .requests import build_detokenize_request, build_generate_request, build_tokenize_request
from .results import model_info_of, result_of


@dataclass(frozen=True)
class UnaryCall:
    rpc: str  # the stub's method name, e.g. "Tokenize"
    request: Any  # its request message
    convert: Callable[[Any], Any]  # response message -> what the SDK returns
    span: str | None = None  # the CLIENT span's rpc name (generate only); None: no span of its own
    service: str = "dspine"  # "dspine" (dspine.v1.DSpine) or "health" (grpc.health.v1.Health)
    retried: bool = True  # under the client's RetryPolicy (else one try)


def generate(prompt: str | None, options: Mapping[str, Any]) -> UnaryCall:
    request = build_generate_request(prompt, **options)
    asked_logprobs = request.sampling.HasField("logprobs")
    return UnaryCall("Generate", request, lambda response: result_of(response, asked_logprobs), span="Generate")


def tokenize(text: str | None, messages, add_special_tokens: bool | None) -> UnaryCall:
    request = build_tokenize_request(text, messages, add_special_tokens)
    return UnaryCall("Tokenize", request, lambda response: list(response.token_ids))


def detokenize(token_ids: Sequence[int], skip_special_tokens: bool) -> UnaryCall:
    request = build_detokenize_request(token_ids, skip_special_tokens)
    return UnaryCall("Detokenize", request, lambda response: response.text)


def info() -> UnaryCall:
    return UnaryCall("GetModelInfo", pb.GetModelInfoRequest(), model_info_of)


def health(service: str) -> UnaryCall:
    # Not retried: a health check reports what it finds (UNAVAILABLE included) at once.
    from grpc_health.v1 import health_pb2

    return UnaryCall("Check", health_pb2.HealthCheckRequest(service=service),
                     lambda response: health_pb2.HealthCheckResponse.ServingStatus.Name(response.status),
                     service="health", retried=False)
