"""The dspine.v1 service over one engine: proto <-> replica dataclasses, nothing else.

Two layers, so that Ray Serve's gRPC proxy can reuse the first without the
standalone server's bootstrap:

- :class:`DSpineService` holds the engine and speaks protos. Its methods take
  request messages and return (or, for streams, asynchronously yield)
  response messages; failures are raised as the engine's typed errors
  (``InvalidRequestError``, ``EngineFullError``, ...). No gRPC context here.
- :class:`DSpineServicer` is the ``grpc.aio`` adapter: it calls the service,
  writes the results and maps every exception to a status in one place
  (:mod:`dspine.cluster.errors`). It also tracks in-flight calls so a server
  can drain them (:meth:`DSpineServicer.begin_drain`, :meth:`wait_idle`).

Engine calls that take the engine lock (admission, cancel, tokenization) run
in the event loop's default executor, so a long engine step never stalls the
loop that serves every other call. A cancelled call (client cancel, deadline,
server stop) cancels its request in the engine and frees its slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from dspine.protos.dspine.v1 import dspine_pb2 as pb
from dspine.protos.dspine.v1 import dspine_pb2_grpc as pb_grpc
from dspine.replica.errors import (
    EngineStoppedError,
    InvalidRequestError,
    RequestCancelledError,
    RequestFailedError,
)
from dspine.replica.types import RequestStats, StreamChunk

from . import tracing
from .chat import ChatTemplate
from .errors import abort, describe
from .validation import (
    GenerateInput,
    PreparedRequest,
    ValidationLimits,
    encode_chat,
    prepare_generate,
    validate_generate,
    validate_text,
    validate_token_ids,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DSpine"].full_name  # "dspine.v1.DSpine"

_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty", "logprobs")


# ------------------------------------------------------------ proto -> data
class MalformedMessage:
    """Stands in for a request whose bytes did not parse (see :func:`add_to_server`)."""

    def __init__(self, message_type: type[Message], error: Exception):
        self.message_type = message_type
        self.error = error


def check_wire(request) -> None:
    """Reject undecodable bytes and fields this schema does not know (a newer client)."""
    if isinstance(request, MalformedMessage):
        raise InvalidRequestError(
            "request", f"not a valid {request.message_type.DESCRIPTOR.full_name} "
                       f"(malformed protobuf or invalid UTF-8 in a string): {request.error}")
    _check_unknown(request, "")


def _check_unknown(message: Message, path: str) -> None:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        number = unknown[0].field_number
        where = f"{path}.#{number}" if path else f"#{number}"
        raise InvalidRequestError(
            where, f"unknown field number {number} in {message.DESCRIPTOR.full_name}; this server does not support it")
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        sub = f"{path}.{field.name}" if path else field.name
        if field.message_type.GetOptions().map_entry:  # a map iterates as its keys
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    _check_unknown(item, f"{sub}[{key!r}]")
            continue
        if field.is_repeated:
            for i, item in enumerate(value):
                _check_unknown(item, f"{sub}[{i}]")
        else:
            _check_unknown(value, sub)


def _chat_data(chat: pb.ChatMessages) -> dict:
    data = {"messages": tuple({"role": m.role, "content": m.content} for m in chat.messages)}
    if chat.HasField("add_generation_prompt"):
        data["add_generation_prompt"] = chat.add_generation_prompt
    return data


def generate_input_data(request: pb.GenerateRequest) -> dict:
    """A ``GenerateRequest`` as the plain data :func:`validate_generate` checks (unset stays unset)."""
    data: dict = {}
    kind = request.WhichOneof("prompt")
    if kind == "text":
        data["text"] = request.text
    elif kind == "token_ids":
        data["token_ids"] = tuple(request.token_ids.ids)
    elif kind == "messages":
        data.update(_chat_data(request.messages))
    if request.HasField("sampling"):
        s = request.sampling
        sampling = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
        sampling.update(stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                        logit_bias=dict(s.logit_bias), reproducible=s.reproducible)
        data["sampling"] = sampling
    if request.HasField("speculative"):
        data["speculative"] = request.speculative
    data["request_id"] = request.request_id
    return data


# ------------------------------------------------------------ data -> proto
def _logprobs_pb(entries) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top]) for e in entries or ()]


def _fill_final(msg, stats: RequestStats | None, prompt_tokens: int, completion_tokens: int,
                finish_reason: str) -> None:
    msg.finish_reason = _FINISH_REASONS[finish_reason]
    msg.usage.prompt_tokens = prompt_tokens
    msg.usage.completion_tokens = completion_tokens
    if stats is None:
        return
    spec = msg.speculation
    spec.speculative = stats.speculative
    if stats.spec is not None:
        spec.cycles = stats.spec.num_cycles
        spec.mean_accepted_len = stats.spec.mean_accepted_len
        spec.accepted_len_histogram.extend(stats.spec.accepted_len_histogram)
        spec.draft_tokens = stats.spec.num_draft_tokens
        spec.accepted_tokens = stats.spec.num_accepted_tokens
    t = stats.stage_times
    timings = msg.timings
    timings.prefill, timings.draft, timings.tail = t.prefill, t.draft, t.tail
    timings.verify, timings.commit, timings.target_step = t.verify, t.commit, t.target_step
    timings.other = t.other
    timings.time_to_first_token = stats.time_to_first_token or 0.0
    if stats.scheduled_time is not None:
        timings.queue = stats.scheduled_time - stats.arrival_time


def _raise_if_abnormal(chunk: StreamChunk) -> None:
    if chunk.finish_reason == "cancelled":
        raise RequestCancelledError(f"request {chunk.request_id} was cancelled")
    if chunk.finish_reason not in _FINISH_REASONS:
        raise RequestFailedError(chunk.error or f"request {chunk.request_id} ended with {chunk.finish_reason!r}")


# ----------------------------------------------------------------- service
class DSpineService:
    """The dspine.v1 methods over one engine, as plain async functions on protos.

    Starts the engine's background loop. ``model_name`` is reported by
    ``GetModelInfo`` (e.g. the target directory's name).
    """

    def __init__(self, engine, model_name: str = "", limits: ValidationLimits | None = None, metrics=None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics  # a ServingMetrics, or None
        self.limits = limits or ValidationLimits.from_engine(engine)
        self.tokenizer = engine.tokenizer
        template = getattr(self.tokenizer, "chat_template", None)
        self.chat_template = ChatTemplate(template, *self._special_tokens()) if template else None
        self.accepting = True  # False while draining: new generations get UNAVAILABLE
        engine.start()

    def _special_tokens(self) -> tuple[str, str]:
        tok = self.tokenizer
        raw = getattr(tok, "tokenizer", None)
        if raw is None:
            return "", ""
        bos = raw.id_to_token(tok.bos_token_id) if tok.bos_token_id is not None else None
        eos = raw.id_to_token(tok.eos_token_ids[0]) if tok.eos_token_ids else None
        return bos or "", eos or ""

    # ------------------------------------------------------------- generate
    def _prepare(self, request: pb.GenerateRequest) -> PreparedRequest:
        check_wire(request)
        checked: GenerateInput = validate_generate(generate_input_data(request), self.limits)
        return prepare_generate(checked, self.limits, self.tokenizer, self.chat_template)

    def _admit(self, request: pb.GenerateRequest, sink) -> PreparedRequest:
        """Validate and admit (runs in an executor thread: encoding and the engine lock may take a while)."""
        if not self.accepting:
            raise EngineStoppedError("server is shutting down; retry on another replica")
        prepared = self._prepare(request)
        self.engine.add_request(prepared.prompt_token_ids, prepared.params, prepared.speculative,
                                prepared.request_id, sink=sink)
        return prepared

    def _cancel_soon(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        loop.run_in_executor(None, self.engine.cancel, request_id)

    def _finished(self, prepared: PreparedRequest, chunk: StreamChunk, trace_ctx) -> None:
        """Exporters of a finished request: its stage spans (under ``trace_ctx``) and metrics."""
        if self.metrics is not None:
            self.metrics.record_engine(chunk.stats)
        if trace_ctx is not None and tracing.enabled():
            attributes = {"gen_ai.request.model": self.model_name,
                          **tracing.result_attributes(prepared.request_id, chunk.finish_reason, chunk.stats)}
            tracing.record_engine_spans(chunk.stats, trace_ctx, attributes)

    async def _chunks(self, request: pb.GenerateRequest, trace_ctx=None
                      ) -> AsyncIterator[tuple[PreparedRequest, StreamChunk]]:
        """Admit the request and yield its engine chunks; leaving early cancels it in the engine."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamChunk] = asyncio.Queue()

        def sink(chunk: StreamChunk) -> None:  # called on the engine's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except RuntimeError:  # the loop is closed: nobody listens, the request is being cancelled
                pass

        admission = loop.run_in_executor(None, self._admit, request, sink)
        try:
            prepared = await asyncio.shield(admission)
        except asyncio.CancelledError:
            # Cancelled while admission runs: cancel the request once it is in.
            admission.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else self._cancel_soon(loop, f.result().request_id))
            raise
        finished = False
        try:
            while not finished:
                chunk = await queue.get()
                finished = chunk.finished
                yield prepared, chunk
        finally:
            if finished:  # after the last message went out: exporters never delay a reply
                self._finished(prepared, chunk, trace_ctx)
            else:
                self._cancel_soon(loop, prepared.request_id)

    async def generate(self, request: pb.GenerateRequest, trace_ctx=None) -> pb.GenerateResponse:
        """Generate to completion; ``trace_ctx`` (an OpenTelemetry context) parents its stage spans."""
        token_ids: list[int] = []
        texts: list[str] = []
        logprobs: list = []
        async with contextlib.aclosing(self._chunks(request, trace_ctx)) as chunks:
            async for prepared, chunk in chunks:
                token_ids += chunk.token_ids
                texts.append(chunk.text)
                logprobs += chunk.logprobs or []
                if chunk.finished:
                    _raise_if_abnormal(chunk)
                    response = pb.GenerateResponse(request_id=prepared.request_id, text="".join(texts),
                                                   token_ids=token_ids, logprobs=_logprobs_pb(logprobs))
                    _fill_final(response, chunk.stats, len(prepared.prompt_token_ids), len(token_ids),
                                chunk.finish_reason)
                    return response
        raise RequestFailedError("the engine ended the request without a final chunk")

    async def generate_stream(self, request: pb.GenerateRequest, trace_ctx=None
                              ) -> AsyncIterator[pb.GenerateStreamResponse]:
        completion_tokens = 0
        async with contextlib.aclosing(self._chunks(request, trace_ctx)) as chunks:
            async for prepared, chunk in chunks:
                completion_tokens += len(chunk.token_ids)
                if chunk.finished:
                    _raise_if_abnormal(chunk)
                message = pb.GenerateStreamResponse(request_id=prepared.request_id, text=chunk.text,
                                                    token_ids=chunk.token_ids, logprobs=_logprobs_pb(chunk.logprobs))
                if chunk.finished:
                    _fill_final(message, chunk.stats, len(prepared.prompt_token_ids), completion_tokens,
                                chunk.finish_reason)
                yield message

    # --------------------------------------------------------- tokenization
    def _require_tokenizer(self, field: str) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError(field, "this server has no tokenizer")

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        check_wire(request)
        kind = request.WhichOneof("input")
        if kind == "text":
            validate_text(request.text, self.limits, "text")
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = self.tokenizer.encode(request.text, add_special_tokens=add_special)
        elif kind == "messages":
            checked = validate_generate(_chat_data(request.messages), self.limits)
            ids = encode_chat(checked.messages, checked.add_generation_prompt, self.tokenizer, self.chat_template)
        else:
            raise InvalidRequestError("input", "one of text or messages is required")
        return pb.TokenizeResponse(token_ids=ids)

    def _detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        check_wire(request)
        self._require_tokenizer("token_ids")
        ids = validate_token_ids(request.token_ids, self.limits, allow_empty=True)
        return pb.DetokenizeResponse(text=self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens))

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        return await asyncio.get_running_loop().run_in_executor(None, self._tokenize, request)

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        return await asyncio.get_running_loop().run_in_executor(None, self._detokenize, request)

    async def model_info(self, request: pb.GetModelInfoRequest | None = None) -> pb.ModelInfo:
        if request is not None:
            check_wire(request)
        engine, limits = self.engine, self.limits
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else tuple(engine.target.args.eos_token_id)
        return pb.ModelInfo(
            target_name=self.model_name,
            target_type=str(getattr(engine.target.args, "model_type", "")),
            vocab_size=limits.vocab_size,
            has_drafter=engine.drafter is not None,
            block_size=engine.block_size,
            max_concurrency=engine.config.max_concurrency,
            max_context=limits.max_context,
            has_tokenizer=limits.has_tokenizer,
            has_chat_template=self.chat_template is not None,
            eos_token_ids=list(eos),
            speculative_default=engine.drafter is not None and engine.config.speculative_default,
            default_max_new_tokens=limits.default_max_new_tokens,
        )


# ---------------------------------------------------------------- servicer
class DSpineServicer(pb_grpc.DSpineServicer):
    """``grpc.aio`` adapter of :class:`DSpineService`: status mapping and drain tracking."""

    def __init__(self, service: DSpineService):
        self.service = service
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_active(self) -> int:
        """Generate / GenerateStream calls in progress."""
        return self._active

    def begin_drain(self) -> None:
        """Refuse new generations (UNAVAILABLE); the ones in flight go on."""
        self.service.accepting = False

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no generation is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    @contextlib.contextmanager
    def _tracked(self):
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def _observed(self, rpc: str, request, context):
        """The RPC's span (continuing the caller's W3C context) and its status metric."""
        span = tracing.RequestSpan(rpc, request, self.service.model_name,
                                   tracing.context_from_metadata(context.invocation_metadata()))
        start = time.perf_counter()
        code, error = "OK", None
        try:
            yield span
        except asyncio.CancelledError:
            code, error = "CANCELLED", "the call was cancelled"
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status here, in errors.py
            described = describe(e)  # once: an unexpected error is logged with its traceback once
            code, error = described[0].name, described[1]
            await abort(context, e, described)
        finally:
            span.finish(code, error)
            if self.service.metrics is not None:
                self.service.metrics.record_status(code, time.perf_counter() - start)

    async def Generate(self, request, context):
        with self._tracked():
            async with self._observed("Generate", request, context) as span:
                return await self.service.generate(request, span.context)

    async def GenerateStream(self, request, context):
        with self._tracked():
            async with self._observed("GenerateStream", request, context) as span:
                async with contextlib.aclosing(self.service.generate_stream(request, span.context)) as messages:
                    async for message in messages:
                        await context.write(message)

    async def Tokenize(self, request, context):
        try:
            return await self.service.tokenize(request)
        except Exception as e:  # noqa: BLE001
            await abort(context, e)

    async def Detokenize(self, request, context):
        try:
            return await self.service.detokenize(request)
        except Exception as e:  # noqa: BLE001
            await abort(context, e)

    async def GetModelInfo(self, request, context):
        try:
            return await self.service.model_info(request)
        except Exception as e:  # noqa: BLE001
            await abort(context, e)


def _tolerant(message_type: type[Message]):
    def deserialize(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return MalformedMessage(message_type, e)
    return deserialize


def add_to_server(servicer: DSpineServicer, server) -> None:
    """Register ``servicer`` like ``add_DSpineServicer_to_server``, but a request that does not
    parse reaches the servicer (and gets INVALID_ARGUMENT) instead of failing inside gRPC."""
    import grpc

    methods = pb.DESCRIPTOR.services_by_name["DSpine"].methods
    handlers = {}
    for method in methods:
        request_type = _message_class(method.input_type.name)
        response_type = _message_class(method.output_type.name)
        factory = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                   else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = factory(getattr(servicer, method.name), request_deserializer=_tolerant(request_type),
                                        response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _message_class(name: str) -> type[Message]:
    return getattr(pb, name)  # every dspine.v1 message is a module attribute of dspine_pb2
