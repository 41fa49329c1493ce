"""Client SDK for a dspine server (standalone or Ray Serve): sync and asyncio.

Needs only ``grpcio`` and ``protobuf`` (never Ray, torch or the engine)::

    from dspine.cluster.client import DSpineClient

    with DSpineClient("127.0.0.1:50051", token=None) as client:
        result = client.generate("def fib(n):", max_new_tokens=32, temperature=0.0)
        print(result.text, result.finish_reason, result.usage.completion_tokens)
        for chunk in client.generate_stream(token_ids=[1, 2, 3], max_new_tokens=16, timeout=5.0):
            print(chunk.token_ids, chunk.finish_reason)

``AsyncDSpineClient`` has the same methods as coroutines (``generate_stream``
returns an async iterator). Prompt: exactly one of ``prompt`` (text),
``token_ids`` or ``messages`` (``[{"role": "user", "content": "..."}]``).
Sampling keywords: ``max_new_tokens, temperature, top_k, top_p, seed, stop,
stop_token_ids, ignore_eos``, vLLM's ``min_p, repetition_penalty,
presence_penalty, frequency_penalty, logit_bias`` (``{token_id: bias}``) and
``logprobs`` (n: results and chunks then carry ``logprobs``, one
:class:`TokenLogprob` per token), and ``reproducible`` (with ``seed``: the same
tokens with speculation on or off and in any batch); ``speculative`` (None = the server's default)
and ``request_id``. Unset keywords take the server's defaults.

- ``timeout=`` (seconds) is the deadline of the whole call, retries included;
  the client's ``timeout`` is the default.
- ``application=`` names the Ray Serve application to call (needed only when
  the cluster runs more than one).
- Unary calls (``generate``, ``tokenize``, ``detokenize``, ``info``) are retried
  on UNAVAILABLE with exponential backoff and jitter (:class:`RetryPolicy`).
  A stream is retried only if UNAVAILABLE arrives before its first message.
- Failures raise :mod:`dspine.cluster.client_errors` types (``InvalidArgument``
  with ``.field``, ``ResourceExhausted``, ``DeadlineExceeded``, ...).
- Cancelling a stream (``stream.cancel()``, leaving a ``with`` block, or
  cancelling the task of an async one) cancels the request on the server.
- With OpenTelemetry's SDK tracer provider installed, each generate call is a
  CLIENT span (``dspine.v1.DSpine/Generate[Stream]``, a child of the active
  span) whose W3C context (``traceparent``) travels in the call metadata, so
  the server's spans join the caller's trace; the stream's span ends with it
  (finished, failed or cancelled). ``cancel()`` works the same with tracing on.
"""

from __future__ import annotations

from ..client_errors import (
    Cancelled,
    DeadlineExceeded,
    DSpineClientError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .aio import AsyncDSpineClient, AsyncGenerateStream
from .requests import build_generate_request
from .results import GenerateChunk, GenerateResult, ModelInfo, SpeculationStats, StageTimings, TokenLogprob, Usage
from .retry import NO_RETRY, RetryPolicy
from .sync import DSpineClient, GenerateStream

# The package's modules, one job each: results (dataclasses and their wire conversion), requests
# (request messages), calls (each unary RPC as data), retry (policy, deadline, tries), spans
# (tracing), streams (a stream's shared state), core (what both clients share), sync and aio (the
# two faces, which only call and sleep).

__all__ = [
    "DSpineClient",
    "AsyncDSpineClient",
    "GenerateStream",
    "AsyncGenerateStream",
    "GenerateResult",
    "TokenLogprob",
    "GenerateChunk",
    "Usage",
    "SpeculationStats",
    "StageTimings",
    "ModelInfo",
    "RetryPolicy",
    "NO_RETRY",
    "build_generate_request",
    "DSpineClientError",
    "InvalidArgument",
    "FailedPrecondition",
    "ResourceExhausted",
    "Cancelled",
    "DeadlineExceeded",
    "Unavailable",
    "Unauthenticated",
    "Internal",
]
