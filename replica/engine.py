"""The engine of one GPU: target + DSpine drafter, continuous batching, streaming.

This file is the engine core: admission (``add_request``/``cancel``), ``step()`` (which is
``schedule -> run -> update_from_output`` and nothing else) and delivery to sinks. Beside it:
building (engine_loading.py), the front ends (engine_frontends.py), the background loop
(engine_loop.py) and what the engine reports (engine_stats.py), each a mixin of :class:`Engine`.

Requests reach callers through sinks (a queue per request), so the same step serves the
synchronous ``generate``, the iterator ``stream`` and the asyncio ``generate_stream``. Every
parallel torch op runs on the engine's one :class:`DeviceThread`, the thread that also built
its tensors (see that module for why); the model runner's state is touched there only.

Two locks, so that admission never waits for the model:

- ``_lock`` guards the host-side bookkeeping (scheduler, memory ledger, sinks, counters). It is
  held for short stretches only: by ``add_request``/``cancel``, and by a step while it
  schedules and while it applies the runner's output, never while the model runs.
- ``_step_lock`` is held by the device thread for a whole step; only the leak check
  (``num_live_states``) waits on it.

So a full engine refuses, and a cancel is recorded (its request finished, its sink told, its
slot and reservation given back), while a step runs; the runner frees the request's device
state at the next step boundary, on the device thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Callable

from dspine import faults

from .config import EngineConfig
from .description import EngineDescription, describe_engine, resolve_eos_token_ids
from .device_thread import DeviceThread
from .drafters import choose_drafter
from .engine_frontends import EngineFrontends
from .engine_loading import EngineLoading, build_runtime, load_models  # noqa: F401 - load_models re-exported
from .engine_loop import EngineLoop
from .engine_stats import ACCEPTANCE_DECAY, EngineLoad, EngineMonitoring, EngineStats  # noqa: F401 - re-exported
from .errors import EngineStoppedError, InvalidRequestError, NoDrafterError
from .request import Request
from .request_rules import prompt_length_problem, token_id_problem, token_ids_problem
from .sampling import SamplingParams
from .scheduler import FcfsScheduler, RequestEvent
from .speculation_policy import SpeculationPolicy
from .step_stats import StepRecord
from .stopping import StopChecker
from .types import RequestStatus, SpecDecodingStats, StreamChunk

logger = logging.getLogger(__name__)


class Engine(EngineLoading, EngineFrontends, EngineLoop, EngineMonitoring):
    """Target-plus-DSpine engine for one device. Thread-safe; at most ``max_concurrency`` requests."""

    def __init__(self, target, drafter=None, tokenizer=None, config: EngineConfig = EngineConfig(),
                 device_thread: DeviceThread | None = None, sampled_drafter=None):
        self.config = config
        self._device_thread = device_thread or DeviceThread(num_threads=config.num_threads)
        self.device = config.torch_device
        self.target = target
        self.drafter = drafter  # the greedy drafter
        # optional second drafter for requests with temperature >= config.sampled_draft_min_temperature
        self.sampled_drafter = sampled_drafter
        self.tokenizer = tokenizer
        self.max_seq_len = config.max_seq_len or target.args.max_position_embeddings
        self.block_size = drafter.args.block_size if drafter is not None else 0
        runtime = build_runtime(target, drafter, config, self.max_seq_len, self._device_thread, sampled_drafter)
        self.memory_plan = runtime.memory_plan
        self.runner = runtime.runner
        self.admission = runtime.admission
        policy = None
        if drafter is not None and config.adaptive_speculation:
            policy = SpeculationPolicy(self.block_size - 1)
        self.scheduler = FcfsScheduler(config.max_concurrency, policy, self.admission, config.prefill_chunk_tokens,
                                       refuse_when_full=config.admission_when_full == "refuse")
        self.stats = EngineStats(spec=SpecDecodingStats(self.block_size - 1) if drafter is not None else None)
        self._lock = threading.RLock()  # host-side bookkeeping; never held while the model runs
        self._step_lock = threading.RLock()  # a whole step, on the device thread
        self._sinks: dict[str, Callable[[StreamChunk], None]] = {}
        self._work = threading.Condition(self._lock)  # the loop waits here for work
        self._state_freed = threading.Condition(self._lock)  # finished requests' device state freed
        self._loop: Future | None = None  # the background loop, running on the device thread
        self._step_observers: list[Callable[[StepRecord], None]] = []
        self._stopping = False

    # ------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams = SamplingParams(),
                    speculative: bool | None = None, request_id: str | None = None,
                    sink: Callable[[StreamChunk], None] | None = None) -> str:
        """Validate and admit a request; raises at once if invalid or the engine is full
        (never waits for a running step)."""
        speculative = self._resolve_speculative(speculative)
        self._validate_prompt(prompt_token_ids)
        self._validate_logit_bias(params)
        request_id = request_id or uuid.uuid4().hex
        eos = resolve_eos_token_ids(self.tokenizer, self.target.args)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        try:
            checker = StopChecker(params, len(prompt_token_ids), self.max_seq_len, eos, decode)
        except ValueError as e:
            raise InvalidRequestError("stop", str(e)) from e
        drafter = choose_drafter(params.temperature, speculative, self.sampled_drafter is not None,
                                 self.config.sampled_draft_min_temperature)
        request = Request(request_id, prompt_token_ids, params, speculative, checker, max(self.block_size - 1, 0),
                          drafter=drafter)
        with self._waits_for_step_if_faulted(), self._lock:
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

    def describe(self) -> EngineDescription:
        """What a front end may know of this engine: the model's limits, the drafter, the tokenizer."""
        return describe_engine(self)

    def cancel(self, request_id: str) -> bool:
        """Cancel a request at any moment, without waiting for a running step: it ends CANCELLED at
        once (its sink gets the last chunk, its slot and reservation are free); its device state is
        freed at the next step boundary. False if unknown or already finished."""
        with self._waits_for_step_if_faulted(), self._lock:
            events = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_CANCELLED)
            self._deliver(events)
            if events:
                self._free_state_soon()
            return bool(events)

    def _waits_for_step_if_faulted(self):
        """The old locking, for the test that proves admission no longer waits for a step."""
        if faults.active("engine.admission_waits_for_step"):
            return self._step_lock
        return contextlib.nullcontext()

    def _free_state_soon(self) -> None:
        """Have the device thread free finished requests' state (under ``_lock``): the loop when it
        runs (woken here), else a task queued behind any step in progress."""
        self._work.notify_all()
        if self._loop is None:
            self._device_thread.submit(self._free_finished_state)

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

    def has_unfinished(self) -> bool:
        return self.num_unfinished() > 0

    def num_unfinished(self) -> int:
        """Requests admitted and not yet finished (never waits for a step)."""
        with self._lock:
            return self.scheduler.num_unfinished

    def call_on_device_thread(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` on the engine's device thread (torch work that must not start a second
        OpenMP team in this process, e.g. a benchmark's probe) and return its result."""
        return self._device_thread.call(fn, *args, **kwargs)

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestEvent]:
        """One engine step over every admitted request: schedule -> run -> update_from_output."""
        return self._device_thread.call(self._step)

    def _step(self) -> list[RequestEvent]:
        with self._step_lock:
            with self._lock:
                start = time.perf_counter()
                scheduler_output = self.scheduler.schedule()
                if scheduler_output.is_empty:
                    return []
                requests = dict(self.scheduler.requests)  # the step's requests, finished ones included
            # The model runs without ``_lock``: admissions and cancels go through meanwhile (a request
            # cancelled now is skipped by update_from_output and freed below).
            runner_output = self.runner.execute(scheduler_output, requests)
            with self._lock:
                for request_id, entries in runner_output.new_logprobs.items():  # aligned with the committed tokens
                    if request_id in requests:
                        requests[request_id].committed_logprobs.extend(entries)
                events = self.scheduler.update_from_output(scheduler_output, runner_output)
                finished_ids = self.scheduler.take_finished_ids()
            # Free device state now, before callers hear that requests finished: an idle engine
            # may not step again for a while.
            self.runner.free_requests(finished_ids)
            with self._lock:
                record = StepRecord(self.stats.num_steps, start, time.perf_counter(), runner_output.stage_intervals,
                                    runner_output.num_verified, runner_output.accepted_len)
                self._account(runner_output, record, requests)
                self._deliver(events)
                self.stats.last_progress = time.monotonic()
                self._state_freed.notify_all()
                observers = list(self._step_observers)
            for observer in observers:
                try:
                    observer(record)
                except Exception:  # noqa: BLE001 - an exporter never breaks a step
                    logger.exception("step observer failed")
            return events

    def _free_finished_state(self) -> None:
        """Free the device state of requests finished outside a step (cancel, shutdown); device thread."""
        with self._step_lock:
            with self._lock:
                finished_ids = self.scheduler.take_finished_ids()
            self.runner.free_requests(finished_ids)
            with self._lock:
                self._state_freed.notify_all()

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
                self.stats.recent_accepted_len += ACCEPTANCE_DECAY * (accepted - self.stats.recent_accepted_len)

    def _deliver(self, events: list[RequestEvent]) -> None:
        """Hand each event's released tokens to its sink (under ``_lock``); the last chunk ends it."""
        for event in events:
            request, release = event.request, event.release
            finished = release.status is not None
            if finished:
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
                logprobs=self._logprobs_of_release(request, release),
            ))

    @staticmethod
    def _logprobs_of_release(request: Request, release) -> list | None:
        """The logprobs of the tokens ``release`` lets out: the released tokens are always a prefix of
        the committed ones (stop rules only cut the end), so they are a slice of the committed entries."""
        if request.params.logprobs is None:
            return None
        start = len(request.released_token_ids) - len(release.token_ids)
        return request.committed_logprobs[start:start + len(release.token_ids)]

