"""The engine's front ends: sync ``generate``/``stream``/``generate_many``, the async
``generate_stream`` and the text helpers.

Each is a thin face over the core's ``add_request`` + a sink (one queue per request) +
``cancel``: without the background loop a sync front end steps the engine itself; with it,
it only waits for its chunks. The :class:`EngineFrontends` mixin of ``Engine``.
"""

from __future__ import annotations

import asyncio
import queue
import uuid
from typing import AsyncIterator, Iterator

from .errors import InvalidRequestError
from .sampling import SamplingParams
from .types import GenerationResult, StreamChunk


class EngineFrontends:
    """Generation front ends over the engine core (``add_request``, ``step``, ``cancel``)."""

    # ------------------------------------------------------ sync front ends
    def stream(self, prompt_token_ids: list[int], params: SamplingParams = SamplingParams(),
               speculative: bool | None = None, request_id: str | None = None) -> Iterator[StreamChunk]:
        """Yield chunks as cycles commit tokens; closing the iterator cancels the request."""
        chunks: queue.Queue[StreamChunk] = queue.Queue()
        request_id = self.add_request(prompt_token_ids, params, speculative, request_id, sink=chunks.put)
        finished = False
        try:
            while not finished:
                if self._loop is None:
                    while chunks.empty():
                        self.step()
                chunk = chunks.get()
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.cancel(request_id)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams = SamplingParams(),
                 speculative: bool | None = None, request_id: str | None = None) -> GenerationResult:
        """Generate to completion; returns tokens, text, finish reason and stats."""
        return self.generate_many([prompt_token_ids], params, speculative, request_ids=[request_id] if request_id else None)[0]

    def generate_many(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams(),
                      speculative: bool | None = None, request_ids: list[str] | None = None,
                      max_in_flight: int | None = None) -> list[GenerationResult]:
        """Run many prompts with continuous batching: at most ``max_in_flight`` at once (default and
        cap: the engine's ``max_concurrency``), each finished one's slot taken by the next prompt."""
        if max_in_flight is not None and max_in_flight < 1:
            raise InvalidRequestError("max_in_flight", f"must be >= 1, got {max_in_flight}")
        in_flight = self.config.max_concurrency if max_in_flight is None else min(max_in_flight,
                                                                                  self.config.max_concurrency)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = request_ids or [uuid.uuid4().hex for _ in prompts]
        chunks: dict[str, list[StreamChunk]] = {i: [] for i in ids}
        done: queue.Queue[str] = queue.Queue()

        def sink_for(request_id):
            def sink(chunk: StreamChunk):
                chunks[request_id].append(chunk)
                if chunk.finished:
                    done.put(request_id)
            return sink

        next_index, num_done = 0, 0
        while num_done < len(prompts):
            while next_index < len(prompts) and self.num_unfinished() < in_flight:
                self.add_request(prompts[next_index], params_list[next_index], speculative, ids[next_index],
                                 sink=sink_for(ids[next_index]))
                next_index += 1
            if self._loop is None:
                self.step()
            else:  # the loop thread steps: block until it finishes one of ours
                done.get()
                num_done += 1
            while not done.empty():
                done.get()
                num_done += 1
        return [self._collect(i, prompt, chunks[i]) for i, prompt in zip(ids, prompts)]

    def _collect(self, request_id: str, prompt: list[int], chunks: list[StreamChunk]) -> GenerationResult:
        last = chunks[-1]
        return GenerationResult(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            token_ids=[t for c in chunks for t in c.token_ids],
            text="".join(c.text for c in chunks) if self.tokenizer is not None else None,
            finish_reason=last.finish_reason,
            stats=last.stats,
            error=last.error,
            logprobs=[e for c in chunks for e in (c.logprobs or [])] if last.logprobs is not None else None,
        )

    # ----------------------------------------------------- async front end
    async def generate_stream(self, prompt_token_ids: list[int], params: SamplingParams = SamplingParams(),
                              speculative: bool | None = None, request_id: str | None = None) -> AsyncIterator[StreamChunk]:
        """Async iterator of chunks, driven by the background loop; cancel/close frees the slot."""
        self.start()
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[StreamChunk] = asyncio.Queue()
        request_id = self.add_request(prompt_token_ids, params, speculative, request_id,
                                      sink=lambda c: loop.call_soon_threadsafe(chunks.put_nowait, c))
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.cancel(request_id)

    # ---------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this engine has no tokenizer; send token ids")
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError("token_ids", "this engine has no tokenizer")
        return self.tokenizer.decode(token_ids)

    def generate_text(self, prompt: str, params: SamplingParams = SamplingParams(),
                      speculative: bool | None = None) -> GenerationResult:
        """Encode ``prompt`` with the target's tokenizer and generate."""
        return self.generate(self.encode(prompt), params, speculative)
