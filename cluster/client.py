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

import asyncio
import logging
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from dspine.protos.dspine.v1 import dspine_pb2 as pb
from dspine.protos.dspine.v1 import dspine_pb2_grpc as pb_grpc

from .client_errors import (
    Cancelled,
    DeadlineExceeded,
    DSpineClientError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)

try:  # optional: trace context propagation
    from opentelemetry import propagate as _otel_propagate
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - exercised where opentelemetry is absent
    _otel_propagate = _otel_trace = None

__all__ = [
    "DSpineClient",
    "AsyncDSpineClient",
    "GenerateResult",
    "TokenLogprob",
    "GenerateChunk",
    "Usage",
    "SpeculationStats",
    "StageTimings",
    "ModelInfo",
    "RetryPolicy",
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

logger = logging.getLogger(__name__)

_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class SpeculationStats:
    speculative: bool = False
    cycles: int = 0
    mean_accepted_len: float = 0.0  # accepted draft tokens per cycle
    accepted_len_histogram: tuple[int, ...] = ()
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class StageTimings:
    """Seconds of the request's own stage intervals (the whole wall time of each stage it took part in)."""

    prefill: float = 0.0
    draft: float = 0.0
    tail: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    target_step: float = 0.0
    time_to_first_token: float = 0.0
    other: float = 0.0  # the rest of its steps: other requests' stages, bookkeeping
    queue: float = 0.0  # admitted -> its first step


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the top-n alternatives ``(token_id, logprob)``, descending."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    usage: Usage
    speculation: SpeculationStats
    timings: StageTimings
    logprobs: list[TokenLogprob] | None = None  # one per token when the request asked (sampling logprobs)

    @property
    def decode_tokens_per_second(self) -> float:
        """Output tokens after the first over the engine's time after the first token (as the
        engine's own ``RequestStats.decode_tokens_per_second``, from the server's timings)."""
        t = self.timings
        in_steps = t.prefill + t.draft + t.tail + t.verify + t.commit + t.target_step + t.other
        elapsed = t.queue + in_steps - t.time_to_first_token  # finish - first token
        tokens = len(self.token_ids)
        return (tokens - 1) / elapsed if tokens > 1 and elapsed > 0 else 0.0


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message; the last has ``finish_reason`` and the stats."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    speculation: SpeculationStats | None = None
    timings: StageTimings | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ModelInfo:
    target_name: str
    target_type: str
    vocab_size: int
    has_drafter: bool
    block_size: int
    max_concurrency: int
    max_context: int
    has_tokenizer: bool
    has_chat_template: bool
    eos_token_ids: tuple[int, ...]
    speculative_default: bool
    default_max_new_tokens: int


def _usage(m: pb.Usage) -> Usage:
    return Usage(m.prompt_tokens, m.completion_tokens)


def _speculation(m: pb.SpeculationStats) -> SpeculationStats:
    return SpeculationStats(m.speculative, m.cycles, m.mean_accepted_len, tuple(m.accepted_len_histogram),
                            m.draft_tokens, m.accepted_tokens)


def _timings(m: pb.StageTimings) -> StageTimings:
    return StageTimings(m.prefill, m.draft, m.tail, m.verify, m.commit, m.target_step, m.time_to_first_token,
                        m.other, m.queue)


def _logprobs(entries) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in entries]


def _result(m: pb.GenerateResponse, asked_logprobs: bool = False) -> GenerateResult:
    return GenerateResult(m.request_id, m.text, list(m.token_ids), _FINISH_REASONS.get(m.finish_reason, "stop"),
                          _usage(m.usage), _speculation(m.speculation), _timings(m.timings),
                          _logprobs(m.logprobs) if asked_logprobs or len(m.logprobs) else None)


def _chunk(m: pb.GenerateStreamResponse) -> GenerateChunk:
    reason = _FINISH_REASONS.get(m.finish_reason)
    if reason is None:
        return GenerateChunk(m.request_id, m.text, list(m.token_ids), logprobs=_logprobs(m.logprobs))
    return GenerateChunk(m.request_id, m.text, list(m.token_ids), reason, _usage(m.usage),
                         _speculation(m.speculation), _timings(m.timings), _logprobs(m.logprobs))


def _model_info(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(m.target_name, m.target_type, m.vocab_size, m.has_drafter, m.block_size, m.max_concurrency,
                     m.max_context, m.has_tokenizer, m.has_chat_template, tuple(m.eos_token_ids),
                     m.speculative_default, m.default_max_new_tokens)


# ----------------------------------------------------------------- requests
def _set(target, name: str, value, path: str) -> None:
    """Assign a proto field; a value protobuf refuses becomes InvalidArgument naming the field."""
    try:
        if isinstance(value, (list, tuple)):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{path}: {e}", field=path) from None


def _chat(messages, add_generation_prompt: bool | None) -> pb.ChatMessages:
    chat = pb.ChatMessages()
    for i, message in enumerate(messages):
        role, content = (message["role"], message["content"]) if isinstance(message, Mapping) else message
        item = chat.messages.add()
        _set(item, "role", role, f"messages[{i}].role")
        _set(item, "content", content, f"messages[{i}].content")
    if add_generation_prompt is not None:
        chat.add_generation_prompt = bool(add_generation_prompt)
    return chat


def build_generate_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                           messages: Iterable | None = None, add_generation_prompt: bool | None = None,
                           max_new_tokens: int | None = None, temperature: float | None = None,
                           top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                           stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                           min_p: float | None = None, repetition_penalty: float | None = None,
                           presence_penalty: float | None = None, frequency_penalty: float | None = None,
                           logit_bias: Mapping[int, float] | None = None, logprobs: int | None = None,
                           reproducible: bool = False,
                           speculative: bool | None = None, request_id: str | None = None) -> pb.GenerateRequest:
    """The ``GenerateRequest`` for these arguments (no range checks: the server owns validation)."""
    given = [name for name, value in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages))
             if value is not None]
    if len(given) != 1:
        raise InvalidArgument(f"prompt: give exactly one of prompt, token_ids or messages (got {given or 'none'})",
                              field="prompt")
    request = pb.GenerateRequest()
    if prompt is not None:
        _set(request, "text", prompt, "text")
    elif token_ids is not None:
        _set(request.token_ids, "ids", list(token_ids), "token_ids")
    else:
        request.messages.CopyFrom(_chat(messages, add_generation_prompt))
    sampling = request.sampling
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p), ("seed", seed), ("min_p", min_p),
                        ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("logprobs", logprobs)):
        if value is not None:
            _set(sampling, name, value, f"sampling.{name}")
    _set(sampling, "stop", list(stop), "sampling.stop")
    _set(sampling, "stop_token_ids", list(stop_token_ids), "sampling.stop_token_ids")
    sampling.ignore_eos = bool(ignore_eos)
    if logit_bias:
        try:
            sampling.logit_bias.update({int(k): float(v) for k, v in dict(logit_bias).items()})
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"sampling.logit_bias: {e}", field="sampling.logit_bias") from None
    sampling.reproducible = bool(reproducible)
    if speculative is not None:
        request.speculative = bool(speculative)
    if request_id:
        _set(request, "request_id", request_id, "request_id")
    return request


def _tokenize_request(text: str | None, messages, add_special_tokens: bool | None) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise InvalidArgument("input: give exactly one of text or messages", field="input")
    request = pb.TokenizeRequest()
    if text is not None:
        _set(request, "text", text, "text")
    else:
        request.messages.CopyFrom(_chat(messages, None))
    if add_special_tokens is not None:
        request.add_special_tokens = bool(add_special_tokens)
    return request


# ------------------------------------------------------------ call policy
@dataclass(frozen=True)
class RetryPolicy:
    """Retries of unary calls on UNAVAILABLE: ``max_attempts`` tries in all, exponential backoff."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # +- fraction of each delay
    retry_codes: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * (1.0 + random.uniform(-self.jitter, self.jitter))


NO_RETRY = RetryPolicy(max_attempts=1)


def _trace_metadata(span: "_ClientSpan | None" = None) -> list[tuple[str, str]]:
    """W3C trace context (``traceparent``, ``tracestate``) of the call's span, else of the active
    span; empty without OpenTelemetry or a span."""
    if _otel_propagate is None:
        return []
    try:
        ctx = _otel_trace.set_span_in_context(span.span) if span is not None and span.span is not None else None
        if ctx is None and not _otel_trace.get_current_span().get_span_context().is_valid:
            return []
        carrier: dict[str, str] = {}
        _otel_propagate.inject(carrier, context=ctx)
        return [(key.lower(), value) for key, value in carrier.items()]
    except Exception:  # noqa: BLE001 - tracing never breaks a call
        logger.debug("trace context injection failed", exc_info=True)
        return []


class _ClientSpan:
    """The SDK's span of one call (CLIENT kind), when OpenTelemetry's SDK provider is installed;
    its W3C context travels in the call's metadata. A no-op without tracing."""

    def __init__(self, rpc: str | None):
        self.span = None
        if _otel_trace is None or rpc is None:
            return
        try:
            span = _otel_trace.get_tracer("dspine.client").start_span(
                f"dspine.v1.DSpine/{rpc}", kind=_otel_trace.SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.method": rpc})
            if span.get_span_context().is_valid:
                self.span = span
        except Exception:  # noqa: BLE001 - tracing never breaks a call
            logger.debug("client span failed", exc_info=True)

    def end(self, error: BaseException | None = None) -> None:
        if self.span is None:
            return
        try:
            if error is not None:
                code = getattr(error, "code", None)
                self.span.set_attribute("rpc.grpc.status_code", getattr(code, "name", str(code)))
                self.span.set_status(_otel_trace.Status(_otel_trace.StatusCode.ERROR, str(error)[:500]))
            else:
                self.span.set_attribute("rpc.grpc.status_code", "OK")
            self.span.end()
        except Exception:  # noqa: BLE001
            logger.debug("client span end failed", exc_info=True)
        self.span = None


class _Deadline:
    def __init__(self, timeout: float | None):
        self.end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def allows_sleep(self, seconds: float) -> bool:
        remaining = self.remaining()
        return remaining is None or remaining > seconds


class _ClientBase:
    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, tls_server_name: str | None = None,
                 timeout: float | None = None, retry: RetryPolicy = RetryPolicy(),
                 max_message_bytes: int = 64 * 1024 * 1024, options: Sequence[tuple[str, object]] = (),
                 application: str | None = None):
        self.target = target
        self.timeout = timeout
        self.retry = retry
        self._auth = [("authorization", f"Bearer {token}")] if token else []
        # Ray Serve routes by this metadata key once a cluster runs more than one application.
        self._auth += [("application", application)] if application else []
        self._tls = tls or root_certificates is not None
        self._root_certificates = root_certificates
        self._options = [("grpc.max_receive_message_length", max_message_bytes),
                         ("grpc.max_send_message_length", max_message_bytes), *options]
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))

    def _metadata(self, extra: Sequence[tuple[str, str]] = (), span: _ClientSpan | None = None
                  ) -> list[tuple[str, str]]:
        return [*self._auth, *_trace_metadata(span), *extra]

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    @staticmethod
    def _expired() -> DeadlineExceeded:
        return DeadlineExceeded("deadline exceeded before the call could be (re)tried")


# ------------------------------------------------------------- sync client
class GenerateStream:
    """Iterator of :class:`GenerateChunk`; ``cancel()`` (or leaving ``with``) cancels the request."""

    def __init__(self, start, deadline: _Deadline, retry: RetryPolicy, span: _ClientSpan | None = None):
        self._start, self._deadline, self._retry = start, deadline, retry
        self._span = span or _ClientSpan(None)
        self._received = False
        self._attempt = 1
        self._call = start(deadline.remaining())

    def __iter__(self) -> "GenerateStream":
        return self

    def __next__(self) -> GenerateChunk:
        while True:
            try:
                return self._next()
            except StopIteration:
                self._span.end()
                raise
            except grpc.RpcError as e:
                if self._received or not self._should_retry(e):
                    error = from_rpc_error(e)
                    self._span.end(error)
                    raise error from None
                time.sleep(self._retry.delay(self._attempt - 1))
                self._call = self._start(self._deadline.remaining())

    def _next(self) -> GenerateChunk:
        message = next(self._call)
        self._received = True
        return _chunk(message)

    def _should_retry(self, e: grpc.RpcError) -> bool:
        if e.code() not in self._retry.retry_codes or self._attempt >= self._retry.max_attempts:
            return False
        if not self._deadline.allows_sleep(self._retry.delay(self._attempt)):
            return False
        self._attempt += 1
        return True

    def cancel(self) -> None:
        self._call.cancel()
        self._span.end(Cancelled("the stream was cancelled by this client"))

    close = cancel

    def __enter__(self) -> "GenerateStream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class DSpineClient(_ClientBase):
    """Blocking client. Keyword options: ``token``, ``tls``, ``root_certificates``,
    ``tls_server_name``, ``timeout`` (default per-call deadline), ``retry`` (:class:`RetryPolicy`)."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        if self._tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
            self._channel = grpc.secure_channel(target, credentials, options=self._options)
        else:
            self._channel = grpc.insecure_channel(target, options=self._options)
        self._stub = pb_grpc.DSpineStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "DSpineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float | None = 10.0) -> None:
        """Block until the channel connects (raises Unavailable on timeout)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"could not connect to {self.target} within {timeout}s") from None

    def _unary(self, method, request, timeout: float | None, metadata=(), span: _ClientSpan | None = None):
        deadline = _Deadline(self._timeout(timeout))
        attempt = 1
        while True:
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise self._expired()
            try:
                return method(request, timeout=remaining, metadata=self._metadata(metadata, span))
            except grpc.RpcError as e:
                if e.code() not in self.retry.retry_codes or attempt >= self.retry.max_attempts:
                    raise from_rpc_error(e) from None
                delay = self.retry.delay(attempt)
                if not deadline.allows_sleep(delay):
                    raise from_rpc_error(e) from None
                logger.debug("%s: %s; retry %d in %.2fs", self.target, e.code().name, attempt, delay)
                time.sleep(delay)
                attempt += 1

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **kwargs) -> GenerateResult:
        """Generate to completion (see the module docstring for the keywords)."""
        request = build_generate_request(prompt, **kwargs)
        span = _ClientSpan("Generate")
        try:
            result = _result(self._unary(self._stub.Generate, request, timeout, metadata, span),
                             request.sampling.HasField("logprobs"))
        except BaseException as e:
            span.end(e)
            raise
        span.end()
        return result

    def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None,
                        metadata: Sequence[tuple[str, str]] = (), **kwargs) -> GenerateStream:
        """Stream chunks as the server commits them; the last carries finish_reason and stats."""
        request = build_generate_request(prompt, **kwargs)
        span = _ClientSpan("GenerateStream")
        md = self._metadata(metadata, span)
        return GenerateStream(lambda remaining: self._stub.GenerateStream(request, timeout=remaining, metadata=md),
                              _Deadline(self._timeout(timeout)), self.retry, span)

    def tokenize(self, text: str | None = None, *, messages=None, add_special_tokens: bool | None = None,
                 timeout: float | None = None) -> list[int]:
        request = _tokenize_request(text, messages, add_special_tokens)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   timeout: float | None = None) -> str:
        request = pb.DetokenizeRequest(skip_special_tokens=skip_special_tokens)
        _set(request, "token_ids", list(token_ids), "token_ids")
        return self._unary(self._stub.Detokenize, request, timeout).text

    def info(self, *, timeout: float | None = None) -> ModelInfo:
        return _model_info(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name ("SERVING", "NOT_SERVING", ...)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=self._timeout(timeout), metadata=self._metadata())
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


# ------------------------------------------------------------ async client
class AsyncGenerateStream:
    """Async iterator of :class:`GenerateChunk`; ``cancel()`` cancels the request (the next read
    raises :class:`Cancelled`); cancelling the task that reads it does the same."""

    def __init__(self, start, deadline: _Deadline, retry: RetryPolicy, span: _ClientSpan | None = None):
        self._start, self._deadline, self._retry = start, deadline, retry
        self._span = span or _ClientSpan(None)
        self._received = False
        self._cancelled = False
        self._attempt = 1
        self._call = start(deadline.remaining())

    def __aiter__(self) -> "AsyncGenerateStream":
        return self

    async def __anext__(self) -> GenerateChunk:
        while True:
            try:
                message = await self._call.read()
            except grpc.RpcError as e:
                if self._received or not self._should_retry(e):
                    error = from_rpc_error(e)
                    self._span.end(error)
                    raise error from None
                await asyncio.sleep(self._retry.delay(self._attempt - 1))
                self._call = self._start(self._deadline.remaining())
                continue
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._cancelled and not (task is not None and getattr(task, "cancelling", lambda: 0)()):
                    # cancel() was called on this stream, not on the task reading it
                    raise Cancelled("the stream was cancelled by this client") from None
                self._call.cancel()
                self._span.end(Cancelled("the reading task was cancelled"))
                raise
            if message is grpc.aio.EOF:
                self._span.end()
                raise StopAsyncIteration
            self._received = True
            return _chunk(message)

    _should_retry = GenerateStream._should_retry

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
        self._span.end(Cancelled("the stream was cancelled by this client"))

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "AsyncGenerateStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncDSpineClient(_ClientBase):
    """asyncio client; same options and methods as :class:`DSpineClient`, as coroutines."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        if self._tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
            self._channel = grpc.aio.secure_channel(target, credentials, options=self._options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=self._options)
        self._stub = pb_grpc.DSpineStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncDSpineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_ready(self, timeout: float | None = 10.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise Unavailable(f"could not connect to {self.target} within {timeout}s") from None

    async def _unary(self, method, request, timeout: float | None, metadata=(), span: _ClientSpan | None = None):
        deadline = _Deadline(self._timeout(timeout))
        attempt = 1
        while True:
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise self._expired()
            try:
                return await method(request, timeout=remaining, metadata=self._metadata(metadata, span))
            except grpc.RpcError as e:
                if e.code() not in self.retry.retry_codes or attempt >= self.retry.max_attempts:
                    raise from_rpc_error(e) from None
                delay = self.retry.delay(attempt)
                if not deadline.allows_sleep(delay):
                    raise from_rpc_error(e) from None
                await asyncio.sleep(delay)
                attempt += 1

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       metadata: Sequence[tuple[str, str]] = (), **kwargs) -> GenerateResult:
        request = build_generate_request(prompt, **kwargs)
        span = _ClientSpan("Generate")
        try:
            result = _result(await self._unary(self._stub.Generate, request, timeout, metadata, span),
                             request.sampling.HasField("logprobs"))
        except BaseException as e:
            span.end(e)
            raise
        span.end()
        return result

    def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None,
                        metadata: Sequence[tuple[str, str]] = (), **kwargs) -> AsyncGenerateStream:
        request = build_generate_request(prompt, **kwargs)
        span = _ClientSpan("GenerateStream")
        md = self._metadata(metadata, span)
        return AsyncGenerateStream(lambda remaining: self._stub.GenerateStream(request, timeout=remaining, metadata=md),
                                   _Deadline(self._timeout(timeout)), self.retry, span)

    async def tokenize(self, text: str | None = None, *, messages=None, add_special_tokens: bool | None = None,
                       timeout: float | None = None) -> list[int]:
        request = _tokenize_request(text, messages, add_special_tokens)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                         timeout: float | None = None) -> str:
        request = pb.DetokenizeRequest(skip_special_tokens=skip_special_tokens)
        _set(request, "token_ids", list(token_ids), "token_ids")
        return (await self._unary(self._stub.Detokenize, request, timeout)).text

    async def info(self, *, timeout: float | None = None) -> ModelInfo:
        return _model_info(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                        timeout=self._timeout(timeout), metadata=self._metadata())
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
