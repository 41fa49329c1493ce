"""The dspine.v1 methods over one engine, as plain async functions on protos (no gRPC context here).

:class:`DSpineService` takes request messages and returns (or, for streams,
asynchronously yields) response messages; failures are raised as the typed
errors of :mod:`dspine.replica.errors` / :mod:`dspine.cluster.errors`, which the
gRPC adapter (:mod:`dspine.cluster.grpc_adapter`) and Ray's ingress map to
statuses. The standalone server and the Ray replica both use it.

It knows the engine through its :class:`~dspine.replica.description.EngineDescription`
and four calls: ``start``, ``load`` (lock-free), ``add_request`` and ``cancel``.

Where the work runs (:mod:`dspine.cluster.edge_executors`):

- on the event loop: wire checks and field validation (cheap), and the
  capacity check of a new generation (``engine.load()``, lock-free), so a full
  engine answers RESOURCE_EXHAUSTED at once, whatever the engine or the
  threads are doing;
- admission threads: encoding a text / chat prompt and ``engine.add_request``;
- tokenize threads: Tokenize / Detokenize;
- the cancel thread: ``engine.cancel`` of a call that ended early (client
  cancel, deadline, server stop), which frees the request's slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import AsyncIterator

from dspine import faults
from dspine.protos.dspine.v1 import dspine_pb2 as pb
from dspine.replica.errors import EngineFullError, EngineStoppedError, InvalidRequestError, RequestFailedError
from dspine.replica.types import StreamChunk

from . import tracing
from .chat import ChatTemplate
from .converters import chat_data, fill_final, generate_input_data, logprobs_pb, raise_if_abnormal
from .edge_executors import EdgeExecutors
from .prompt import PreparedRequest, encode_chat, prepare_generate
from .validation import GenerateInput, ValidationLimits, validate_generate, validate_text, validate_token_ids
from .wire_checks import check_wire

logger = logging.getLogger(__name__)

__all__ = ["DSpineService"]


class DSpineService:
    """The dspine.v1 methods over one engine. Starts the engine's background loop.

    ``model_name`` is reported by ``GetModelInfo`` (e.g. the target directory's
    name); ``executors`` are the worker pools (default: a quarter of the cores
    for tokenization, 4 admission threads, one cancel thread, 64 waiting calls per pool)."""

    def __init__(self, engine, model_name: str = "", limits: ValidationLimits | None = None, metrics=None,
                 executors: EdgeExecutors | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics  # a ServingMetrics, or None
        self.description = engine.describe()
        self.limits = limits or ValidationLimits.from_description(self.description)
        self.tokenizer = self.description.tokenizer
        desc = self.description
        self.chat_template = (ChatTemplate(desc.chat_template, desc.bos_token, desc.eos_token)
                              if desc.has_chat_template else None)
        self.executors = executors or EdgeExecutors()
        self.accepting = True  # False while draining: new generations get UNAVAILABLE
        self._admitting = 0  # admissions between the capacity check and engine.add_request's end
        self._admitting_lock = threading.Lock()  # the count is decremented on admission threads
        engine.start()

    def close(self) -> None:
        """Stop the worker threads (after the server stopped taking calls)."""
        self.executors.shutdown()

    # ------------------------------------------------------------- generate
    def _check(self, request: pb.GenerateRequest) -> GenerateInput:
        """Wire and field checks (on the loop: no tokenizer, no engine lock)."""
        check_wire(request)
        return validate_generate(generate_input_data(request), self.limits)

    def _claim_slot(self) -> None:
        """Refuse at once (RESOURCE_EXHAUSTED) when every slot is taken, else count this admission in.

        Taken: the engine's requests (``engine.load()``, lock-free) plus the admissions still
        being encoded or admitted, so a burst of requests does not all pass while the engine's
        count lags. The engine's own check in ``add_request`` still has the last word."""
        if faults.active("servicer.admission_waits_for_engine"):
            with self._admitting_lock:
                self._admitting += 1
            return
        load = self.engine.load()
        with self._admitting_lock:
            taken = load.in_flight + self._admitting
            if taken >= load.max_concurrency:
                raise EngineFullError(taken, load.max_concurrency)
            self._admitting += 1

    def _release_claim(self) -> None:
        with self._admitting_lock:
            self._admitting -= 1

    def _prepare_and_add(self, checked: GenerateInput, sink) -> PreparedRequest:
        """Encode the prompt and admit it (on an admission thread: encoding and the engine lock take a while)."""
        try:
            prepared = prepare_generate(checked, self.limits, self.tokenizer, self.chat_template)
            self.engine.add_request(prepared.prompt_token_ids, prepared.params, prepared.speculative,
                                    prepared.request_id, sink=sink)
        finally:  # in the engine's count now, or refused: either way no longer an admission in progress
            self._release_claim()
        return prepared

    async def _run_admission(self, checked: GenerateInput, sink) -> PreparedRequest:
        ran = []  # whether _prepare_and_add started (it releases the claim itself)

        def admit() -> PreparedRequest:
            ran.append(True)
            return self._prepare_and_add(checked, sink)

        try:
            return await self.executors.run_admission(admit)
        except BaseException:
            if not ran:  # refused by the admission pool, or the pool stopped: the claim is still ours
                self._release_claim()
            raise

    async def _admit(self, request: pb.GenerateRequest, sink) -> PreparedRequest:
        if not self.accepting:
            raise EngineStoppedError("server is shutting down; retry on another replica")
        checked = self._check(request)
        self._claim_slot()
        loop = asyncio.get_running_loop()
        admission = asyncio.ensure_future(self._run_admission(checked, sink))
        try:
            return await asyncio.shield(admission)
        except asyncio.CancelledError:
            # Cancelled while admission runs: cancel the request once it is in.
            admission.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else self._cancel_soon(loop, f.result().request_id))
            raise

    def _cancel_soon(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.executors.cancel_soon(loop, self.engine.cancel, request_id)

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

        prepared = await self._admit(request, sink)
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
                    raise_if_abnormal(chunk)
                    response = pb.GenerateResponse(request_id=prepared.request_id, text="".join(texts),
                                                   token_ids=token_ids, logprobs=logprobs_pb(logprobs))
                    fill_final(response, chunk.stats, len(prepared.prompt_token_ids), len(token_ids),
                               chunk.finish_reason)
                    return response
        raise RequestFailedError("the engine ended the request without a final chunk")

    async def generate_stream(self, request: pb.GenerateRequest, trace_ctx=None
                              ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Generate, yielding each engine chunk as a message; the last one carries the final fields."""
        completion_tokens = 0
        async with contextlib.aclosing(self._chunks(request, trace_ctx)) as chunks:
            async for prepared, chunk in chunks:
                completion_tokens += len(chunk.token_ids)
                if chunk.finished:
                    raise_if_abnormal(chunk)
                message = pb.GenerateStreamResponse(request_id=prepared.request_id, text=chunk.text,
                                                    token_ids=chunk.token_ids, logprobs=logprobs_pb(chunk.logprobs))
                if chunk.finished:
                    fill_final(message, chunk.stats, len(prepared.prompt_token_ids), completion_tokens,
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
            checked = validate_generate(chat_data(request.messages), self.limits)
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
        """Encode a text or a chat conversation (on a tokenize thread)."""
        return await self.executors.run_tokenize(self._tokenize, request)

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        """Decode token ids (on a tokenize thread)."""
        return await self.executors.run_tokenize(self._detokenize, request)

    async def model_info(self, request: pb.GetModelInfoRequest | None = None) -> pb.ModelInfo:
        """What this server serves: the engine's description and the request limits."""
        if request is not None:
            check_wire(request)
        desc, limits = self.description, self.limits
        return pb.ModelInfo(
            target_name=self.model_name,
            target_type=desc.model_type,
            vocab_size=limits.vocab_size,
            has_drafter=desc.has_drafter,
            block_size=desc.block_size,
            max_concurrency=desc.max_concurrency,
            max_context=limits.max_context,
            has_tokenizer=limits.has_tokenizer,
            has_chat_template=self.chat_template is not None,
            eos_token_ids=list(desc.eos_token_ids),
            speculative_default=desc.speculative_default,
            default_max_new_tokens=limits.default_max_new_tokens,
            drafters=list(desc.drafters),
            sampled_draft_min_temperature=desc.sampled_draft_min_temperature or 0.0,
        )
