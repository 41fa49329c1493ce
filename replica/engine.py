"""The engine of one GPU: target + DSpine drafter, continuous batching, streaming.

``step()`` is ``schedule -> run -> update_from_output`` and nothing else.
Requests reach callers through sinks (a queue per request), so the same step
serves the synchronous ``generate``, the iterator ``stream`` and the asyncio
``generate_stream``. Steps run when a caller asks (inline use) or from the
background loop (``start()``) when a server drives the engine; either way
every parallel torch op runs on the engine's one :class:`DeviceThread`, the
thread that also built its tensors (see that module for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator

import torch

from .admission import DraftPoolCapacity, MemoryAdmission, PagedKvCapacity, TargetTokenCapacity
from .config import EngineConfig
from .device_thread import DeviceThread
from .errors import EngineStoppedError, InvalidRequestError, NoDrafterError
from .memory_plan import MemoryPlan, MemoryPlanError, draft_pool_slots, plan_for_engine
from .model_runner import ModelRunner
from .request import Request
from .request_rules import prompt_length_problem, token_id_problem, token_ids_problem
from .sampling import SamplingParams
from .scheduler import FcfsScheduler, RequestEvent
from .speculation_policy import SpeculationPolicy
from .step_stats import StepRecord
from .stopping import StopChecker
from .types import GenerationResult, RequestStatus, SpecDecodingStats, StageTimes, StreamChunk

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Engine-wide counters since start (plain data; exporters live in cluster/)."""

    num_steps: int = 0
    num_finished: int = 0
    num_failed: int = 0
    num_cancelled: int = 0
    stage_times: StageTimes = field(default_factory=StageTimes)
    spec: SpecDecodingStats | None = None
    peak_draft_pool_used: int = 0
    peak_in_flight: int = 0  # high-water mark of admitted, unfinished requests
    num_draft_demoted: int = 0  # speculative requests the draft pool could not extend (went target-only)
    recent_accepted_len: float = 0.0  # accepted draft tokens per cycle, exponentially decayed
    # time.monotonic() at the end of the latest step, or at the admission that ended an idle
    # spell: a health check measures a stall from here.
    last_progress: float = 0.0


# Weight of the newest cycle in ``EngineStats.recent_accepted_len``.
_ACCEPTANCE_DECAY = 0.05


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of how busy the engine is: what a router and a health check read."""

    in_flight: int
    max_concurrency: int
    peak_in_flight: int
    free_draft_slots: int  # 0 without a drafter
    draft_slots: int  # capacity of the draft KV pool (0 without a drafter)
    live_target_states: int
    recent_accepted_len: float
    num_steps: int
    num_finished: int
    seconds_since_progress: float | None  # since the last step or idle-ending admission; None before any
    # Memory admission (replica/admission.py): tokens not reserved by admitted requests, per pool
    # (None: unbounded / no such pool), and requests admitted that wait for memory.
    free_target_tokens: int | None = None
    free_draft_tokens: int | None = None
    waiting_for_memory: int = 0

    @property
    def free_slots(self) -> int:
        return self.max_concurrency - self.in_flight


def _check_memory_plan(target_args, draft_args, config: EngineConfig, max_seq_len: int,
                       target_weight_bytes: int | None = None) -> MemoryPlan:
    """The engine's memory plan; raises :class:`MemoryPlanError` when it does not fit (and the check is on)."""
    plan = plan_for_engine(target_args, draft_args, config, max_seq_len, target_weight_bytes)
    if config.memory_check and not plan.fits:
        raise MemoryPlanError(plan)
    logger.info("%s", plan.format())
    return plan


def _precheck_memory_plan(target_dir, draft_dir, config: EngineConfig) -> None:
    """The plan from the config files alone, so that a misfit fails before gigabytes are loaded."""
    import json

    from .models.dspine_config import DraftArgs
    from .models.target_config import TargetArgs

    target_args = TargetArgs.from_hf_config(json.loads((Path(target_dir) / "config.json").read_text()))
    draft_args = None
    if draft_dir is not None:
        draft_args = DraftArgs.from_config(json.loads((Path(draft_dir) / "config.json").read_text()))
    _check_memory_plan(target_args, draft_args, config, config.max_seq_len or target_args.max_position_embeddings)


def load_models(target_dir, draft_dir, config: EngineConfig, device_thread: DeviceThread):
    """``(target, drafter or None)`` loaded on ``device_thread`` (where the engine will run them)."""
    from .models.loader import load_target

    def load():
        target = load_target(target_dir, device=config.torch_device, dtype=config.torch_dtype)
        drafter = None
        if draft_dir is not None:
            from .models.dspine_checkpoint import load_drafter

            drafter = load_drafter(draft_dir, target.embed_tokens, target.lm_head_weight,
                                   device=config.torch_device, dtype=config.torch_draft_dtype)
        return target, drafter

    return device_thread.call(load)


class Engine:
    """Target-plus-DSpine engine for one device. Thread-safe; at most ``max_concurrency`` requests."""

    def __init__(self, target, drafter=None, tokenizer=None, config: EngineConfig = EngineConfig(),
                 device_thread: DeviceThread | None = None):
        self.config = config
        self._device_thread = device_thread or DeviceThread(num_threads=config.num_threads)
        self.device = config.torch_device
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.max_seq_len = config.max_seq_len or target.args.max_position_embeddings
        self.block_size = drafter.args.block_size if drafter is not None else 0
        # Before the draft pool and tail tables exist: a configuration that cannot fit is refused here.
        self.memory_plan = _check_memory_plan(target.args, drafter.args if drafter is not None else None, config,
                                              self.max_seq_len, sum(p.numel() * p.element_size()
                                                                    for p in target.parameters()))
        draft_pool, tail_tables = self._device_thread.call(self._build_draft_side)
        target_kv_pool = self._device_thread.call(self._build_target_kv_pool)
        self.runner = ModelRunner(target, drafter, tail_tables, draft_pool, config, self.device,
                                  target_kv_pool=target_kv_pool)
        policy = None
        if drafter is not None and config.adaptive_speculation:
            policy = SpeculationPolicy(self.block_size - 1)
        # Admission by memory (replica/admission.py): the target's K/V (its paged pool, or for the
        # contiguous layout a configured token bound) and the draft KV pool.
        if target_kv_pool is not None:
            pools = [PagedKvCapacity(target_kv_pool, verify_rows=max(self.block_size - 1, 0))]
        else:
            pools = [TargetTokenCapacity(config.target_kv_tokens, self._target_tokens_in_use)]
        if draft_pool is not None:
            pools.append(DraftPoolCapacity(draft_pool))
        self.admission = MemoryAdmission(pools, self.max_seq_len, config.admission_reservation, self.block_size)
        self.scheduler = FcfsScheduler(config.max_concurrency, policy, self.admission, config.prefill_chunk_tokens,
                                       refuse_when_full=config.admission_when_full == "refuse")
        self.stats = EngineStats(spec=SpecDecodingStats(self.block_size - 1) if drafter is not None else None)
        self._lock = threading.RLock()
        self._sinks: dict[str, Callable[[StreamChunk], None]] = {}
        self._work = threading.Condition(self._lock)
        self._loop: Future | None = None  # the background loop, running on the device thread
        self._step_observers: list[Callable[[StepRecord], None]] = []
        self._stopping = False

    # ------------------------------------------------------------ building
    @classmethod
    def from_pretrained(cls, target_dir: str | Path, draft_dir: str | Path | None = None,
                        config: EngineConfig = EngineConfig()) -> "Engine":
        """Load an HF-format target directory and optionally a DSpine draft directory."""
        from .tokenizer import Tokenizer

        _precheck_memory_plan(target_dir, draft_dir, config)  # before any weight is loaded

        device_thread = DeviceThread(num_threads=config.num_threads)
        target, drafter = load_models(target_dir, draft_dir, config, device_thread)
        tokenizer = Tokenizer.from_dir(target_dir) if (Path(target_dir) / "tokenizer.json").exists() else None
        return cls(target, drafter, tokenizer, config, device_thread)

    def _target_tokens_in_use(self) -> int:
        """Positions held by live target states (a snapshot; read off the device thread too)."""
        try:
            return sum(s.num_tokens + s.num_pending for s in list(self.runner.states.values()))
        except RuntimeError:  # the dict changed under the read: one step's staleness is fine
            return 0

    def _build_target_kv_pool(self):
        from .models.paged_kv_pool import build_target_kv_pool

        return build_target_kv_pool(self.target, self.config, self.max_seq_len, self.block_size, self.device)

    def _build_draft_side(self):
        if self.drafter is None:
            return None, None
        from .draft_kv_pool import DraftKVPool, RingDraftKVPool
        from .tail import TailTables

        args = self.drafter.args
        # The default sizes hold every admitted request at its largest; the + 1 is the pool's
        # padding sink (slot 0, never allocated). Without it 8 ring requests that all reach a full
        # window need one slot more than exists, and one of them fails.
        slots = draft_pool_slots(self.config.draft_pool, self.config.max_concurrency, self.max_seq_len, args.window,
                                 self.config.draft_pool_tokens)
        if self.config.draft_pool == "ring":
            pool = RingDraftKVPool(args, slots, device=self.device, dtype=self.config.torch_draft_dtype)
        else:
            pool = DraftKVPool(args, slots, device=self.device, dtype=self.config.torch_draft_dtype)
        mode = self.config.retrieval_mode
        tables = TailTables.from_drafter(self.drafter, fp8_retrieval=mode == "fp8", bf16_retrieval=mode == "bf16")
        return pool, tables

    # ------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams = SamplingParams(),
                    speculative: bool | None = None, request_id: str | None = None,
                    sink: Callable[[StreamChunk], None] | None = None) -> str:
        """Validate and admit a request; raises at once if invalid or the engine is full."""
        speculative = self._resolve_speculative(speculative)
        self._validate_prompt(prompt_token_ids)
        self._validate_logit_bias(params)
        request_id = request_id or uuid.uuid4().hex
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else tuple(self.target.args.eos_token_id)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        try:
            checker = StopChecker(params, len(prompt_token_ids), self.max_seq_len, eos, decode)
        except ValueError as e:
            raise InvalidRequestError("stop", str(e)) from e
        request = Request(request_id, prompt_token_ids, params, speculative, checker, max(self.block_size - 1, 0))
        with self._lock:
            if self._stopping:
                raise EngineStoppedError("engine is shutting down")
            if self.scheduler.num_unfinished == 0:
                self.stats.last_progress = time.monotonic()
            self.scheduler.add_request(request)
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.scheduler.num_unfinished)
            if sink is not None:
                self._sinks[request_id] = sink
            self._work.notify_all()
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Cancel a request at any moment; its state and slots are freed. False if unknown."""
        with self._lock:
            events = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_CANCELLED)
            self._deliver(events)
            self._work.notify_all()
            return bool(events)

    def _resolve_speculative(self, speculative: bool | None) -> bool:
        if speculative is None:
            return self.drafter is not None and self.config.speculative_default
        if speculative and self.drafter is None:
            raise NoDrafterError("speculative: no drafter loaded; load one with draft_dir or set speculative=False")
        return bool(speculative)

    def _validate_prompt(self, prompt_token_ids) -> None:
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", "must be a non-empty list of token ids")
        bad = token_ids_problem(prompt_token_ids, self.target.args.vocab_size)
        if bad is not None:
            raise InvalidRequestError("prompt_token_ids", f"element {bad[0]}: {bad[1]}")
        too_long = prompt_length_problem(len(prompt_token_ids), self.max_seq_len)
        if too_long is not None:
            raise InvalidRequestError("prompt_token_ids", too_long)

    def _validate_logit_bias(self, params: SamplingParams) -> None:
        for token_id, _ in params.logit_bias:
            problem = token_id_problem(token_id, self.target.args.vocab_size)
            if problem is not None:
                raise InvalidRequestError("logit_bias", problem)

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestEvent]:
        """One engine step over every admitted request: schedule -> run -> update_from_output."""
        return self._device_thread.call(self._step)

    def _step(self) -> list[RequestEvent]:
        with self._lock:
            start = time.perf_counter()
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                return []
            requests = dict(self.scheduler.requests)  # the step's requests, finished ones included
            runner_output = self.runner.execute(scheduler_output, self.scheduler.requests)
            for request_id, entries in runner_output.new_logprobs.items():  # aligned with the committed tokens
                if request_id in requests:
                    requests[request_id].committed_logprobs.extend(entries)
            events = self.scheduler.update_from_output(scheduler_output, runner_output)
            record = StepRecord(self.stats.num_steps, start, time.perf_counter(), runner_output.stage_intervals,
                                runner_output.num_verified, runner_output.accepted_len)
            self._account(runner_output, record, requests)
            self._deliver(events)
            self.stats.last_progress = time.monotonic()
            for observer in self._step_observers:
                try:
                    observer(record)
                except Exception:  # noqa: BLE001 - an exporter never breaks a step
                    logger.exception("step observer failed")
            return events

    def has_unfinished(self) -> bool:
        return self.num_unfinished() > 0

    def num_unfinished(self) -> int:
        """Requests admitted and not yet finished (read under the engine lock)."""
        with self._lock:
            return self.scheduler.num_unfinished

    def _account(self, runner_output, record: StepRecord, requests: dict) -> None:
        """Engine-wide sums, and each request of the step charged with its own stage intervals."""
        for request_id in record.request_ids:
            request = requests.get(request_id)
            if request is None:
                continue
            request.stats.stage_times.add(record.own_times(request_id))
            request.stats.steps.append(record)
            if request.stats.scheduled_time is None:
                request.stats.scheduled_time = record.start
        self.stats.num_steps += 1
        self.stats.stage_times.add(runner_output.stage_times)
        self.stats.peak_draft_pool_used = max(self.stats.peak_draft_pool_used, runner_output.draft_pool_used)
        self.stats.num_draft_demoted += len(runner_output.draft_demoted)
        if self.stats.spec is not None:
            for request_id, accepted in runner_output.accepted_len.items():
                self.stats.spec.observe_draft(runner_output.num_verified.get(request_id, self.block_size - 1), accepted)
                self.stats.recent_accepted_len += _ACCEPTANCE_DECAY * (accepted - self.stats.recent_accepted_len)

    def _deliver(self, events: list[RequestEvent]) -> None:
        for event in events:
            request, release = event.request, event.release
            finished = release.status is not None
            if finished:
                # Free device state now: an idle engine may not step again for a while.
                self.runner.free([request.request_id])
                request.stats.finish_time = time.perf_counter()
                self.stats.num_finished += 1
                self.stats.num_failed += release.status == RequestStatus.FINISHED_ERROR
                self.stats.num_cancelled += release.status == RequestStatus.FINISHED_CANCELLED
            sink = self._sinks.pop(request.request_id, None) if finished else self._sinks.get(request.request_id)
            if sink is None or (not release.token_ids and not release.text and not finished):
                continue
            sink(StreamChunk(
                request_id=request.request_id,
                token_ids=release.token_ids,
                text=release.text,
                finish_reason=release.status.finish_reason if finished else None,
                stats=request.stats if finished else None,
                error=request.error if finished else None,
                logprobs=self._released_logprobs(request, release),
            ))

    @staticmethod
    def _released_logprobs(request: Request, release) -> list | None:
        """The logprobs of the tokens ``release`` lets out: the released tokens are always a prefix of
        the committed ones (stop rules only cut the end), so they are a slice of the committed entries."""
        if request.params.logprobs is None:
            return None
        start = len(request.released_token_ids) - len(release.token_ids)
        return request.committed_logprobs[start:start + len(release.token_ids)]

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
                      speculative: bool | None = None, request_ids: list[str] | None = None) -> list[GenerationResult]:
        """Run many prompts with continuous batching (at most ``max_concurrency`` at once)."""
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
            while next_index < len(prompts) and self.num_unfinished() < self.config.max_concurrency:
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

    def start(self) -> None:
        """Start the background loop (on the device thread) that steps while requests are in flight."""
        with self._lock:
            if self._loop is not None:
                return
            self._stopping = False
            self._loop = self._device_thread.submit(self._run_loop)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; finish (drain) or cancel the in-flight ones; stop the loop."""
        with self._lock:
            self._stopping = True
            if not drain:
                self._deliver(self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_CANCELLED))
            self._work.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        loop = self._loop
        if loop is None:
            while self.has_unfinished() and (deadline is None or time.monotonic() < deadline):
                self.step()
        else:
            with contextlib.suppress(FutureTimeoutError):
                loop.result(timeout)
        with self._lock:
            self._deliver(self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_CANCELLED))
        if loop is None or loop.done():
            self.step()  # frees the state of everything finished
        with self._lock:
            self._loop = None

    def _run_loop(self) -> None:
        while True:
            with self._lock:
                while self.scheduler.num_unfinished == 0 and not self._stopping:
                    self._work.wait()
                if self._stopping and self.scheduler.num_unfinished == 0:
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a bug in the step itself: fail everything in flight, keep serving
                logger.exception("engine step failed; failing in-flight requests")
                with self._lock:
                    ids = list(self.scheduler.requests)
                    self._deliver(self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR, "engine step failed"))

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

    # ------------------------------------------------------------ observers
    def add_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        """Call ``observer(record)`` after every step (on the device thread: keep it cheap)."""
        with self._lock:
            self._step_observers.append(observer)

    def remove_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        with self._lock:
            self._step_observers.remove(observer)

    def call_on_device_thread(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` on the engine's device thread (torch work that must not start a second
        OpenMP team in this process, e.g. a benchmark's probe) and return its result."""
        return self._device_thread.call(fn, *args, **kwargs)

    def set_precise_timing(self, enabled: bool) -> None:
        """Synchronise the device around each stage so stage intervals are device time (CUDA)."""
        self.runner.precise_timing = enabled

    # --------------------------------------------------------------- state
    def load(self) -> EngineLoad:
        """How busy the engine is now. Lock-free (plain reads of counters), so a router or health
        probe never waits for a step to end; the fields may be one step apart."""
        pool = self.runner.draft_pool
        stats = self.stats
        free = self.admission.free_tokens()
        return EngineLoad(
            in_flight=self.scheduler.num_unfinished,
            max_concurrency=self.config.max_concurrency,
            peak_in_flight=stats.peak_in_flight,
            free_draft_slots=pool.num_free if pool is not None else 0,
            draft_slots=pool.capacity if pool is not None else 0,
            live_target_states=self.runner.num_live_states,
            recent_accepted_len=stats.recent_accepted_len,
            num_steps=stats.num_steps,
            num_finished=stats.num_finished,
            seconds_since_progress=time.monotonic() - stats.last_progress if stats.last_progress else None,
            free_target_tokens=free.get("target K/V"),
            free_draft_tokens=free.get("draft KV pool"),
            waiting_for_memory=self.scheduler.num_waiting_for_memory(),
        )

    def check_health(self, stall_s: float = 60.0) -> None:
        """Raise ``RuntimeError`` when the engine cannot serve: its device thread or loop died,
        or requests are in flight and no step has finished for ``stall_s`` seconds."""
        if not self._device_thread.is_alive:
            raise RuntimeError("engine device thread is not running")
        loop = self._loop
        if loop is not None and loop.done():
            raise RuntimeError(f"engine loop exited: {loop.exception() or 'returned'}")
        load = self.load()
        stalled_s = load.seconds_since_progress
        if load.in_flight and stalled_s is not None and stalled_s > stall_s:
            raise RuntimeError(f"engine stalled: {load.in_flight} requests in flight, "
                               f"no step finished for {stalled_s:.0f}s")

    def num_live_states(self) -> dict[str, int]:
        """Live target states and draft slots (zero when idle: the leak check)."""
        with self._lock:
            pool = self.runner.draft_pool
            return {
                "requests": self.scheduler.num_unfinished,
                "target_states": self.runner.num_live_states,
                "draft_slots": pool.used if pool is not None else 0,
                "target_kv_blocks": self.runner.target_kv_used_blocks(),
            }
