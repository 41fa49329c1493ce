"""The scheduler contract and the first-come-first-served scheduler.

The engine's step is three calls: ``schedule()`` decides what the model runner
does, the runner does it, ``update_from_output()`` applies the result (stop
checks, status changes, stats). The scheduler owns request status; it knows
nothing of tensors.
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass

from dspine import faults

from .admission import MemoryAdmission
from .errors import EngineFullError
from .request import Request
from .slot_refills import SlotRefills
from .speculation_policy import SpeculationPolicy
from .stopping import Release
from .types import RequestStatus, RunnerOutput, SchedulerOutput


@dataclass
class RequestEvent:
    """One request's visible change after a step."""

    request: Request
    release: Release  # tokens/text released this step; ``release.status`` set when it finished


class SchedulerInterface(abc.ABC):
    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Admit a request or raise :class:`EngineFullError` at once (never queue past the cap)."""

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide the next step: which requests prefill, which decode (and how), which to free."""

    @abc.abstractmethod
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestEvent]:
        """Apply the runner's tokens, run stop checks, finish requests; returns per-request events."""

    @abc.abstractmethod
    def finish_requests(self, request_ids: list[str], status: RequestStatus, error: str | None = None) -> list[RequestEvent]:
        """Finish requests from outside a step (cancel, shutdown), also while a step runs; the
        runner frees their device state at the next step boundary (``take_finished_ids``)."""


class FcfsScheduler(SchedulerInterface):
    """All admitted requests run together; new ones are prefilled at the next step.

    The cap ``max_concurrency`` counts every unfinished request, waiting or
    running: the engine never holds more, whatever the router in front does.

    Memory (``admission``, see replica/admission.py): a waiting request starts its
    prefill only once its reservation fits every pool, first come first served (a
    request that does not fit holds back those behind it, so a long one never starves);
    with ``refuse_when_full`` it is refused at add time instead of waiting.

    Chunked prefill: each step prefills at most ``prefill_chunk_tokens`` prompt tokens in
    all, a long prompt over several steps, while the running requests keep decoding.
    """

    def __init__(self, max_concurrency: int, policy: SpeculationPolicy | None = None,
                 admission: MemoryAdmission | None = None, prefill_chunk_tokens: int | None = None,
                 refuse_when_full: bool = False):
        self.max_concurrency = max_concurrency
        self.policy = policy  # None: every speculative request drafts every step
        self.admission = admission  # None: no memory pools to reserve
        self.prefill_chunk_tokens = prefill_chunk_tokens  # None: whole prompts in one step
        self.refuse_when_full = refuse_when_full
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._waiting: deque[str] = deque()  # not yet fully prefilled, in arrival order
        self._prefilled: dict[str, int] = {}  # prompt tokens prefilled so far (waiting requests)
        self._to_free: list[str] = []  # finished, their device state not yet freed by the runner
        self.slot_refills = SlotRefills()  # whether freed slots are taken again (the policy's drain pricing)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_finished_ids(self) -> bool:
        """Whether finished requests wait for the runner to free their device state."""
        return bool(self._to_free)

    def take_finished_ids(self) -> list[str]:
        """The requests finished since the last call, whose device state the runner frees now."""
        finished, self._to_free = self._to_free, []
        return finished

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in flight")
        if len(self.requests) >= self.max_concurrency:
            raise EngineFullError(len(self.requests), self.max_concurrency)
        if self.admission is not None:
            self.admission.check_ever_fits(request)  # RequestTooLargeError: larger than a pool
            queue_ahead = any(not self.admission.is_reserved(r) for r in self._waiting)
            if self.refuse_when_full or not queue_ahead:
                error = self.admission.try_reserve(request)
                if error is not None and self.refuse_when_full:
                    raise error  # PoolExhaustedError naming the pool
        self.requests[request.request_id] = request
        self.slot_refills.on_add()
        self._waiting.append(request.request_id)
        self._prefilled[request.request_id] = 0

    def num_waiting_for_memory(self) -> int:
        """Admitted requests whose reservation does not fit yet."""
        if self.admission is None:
            return 0
        try:  # read lock-free by EngineLoad: a deque mutated under the read raises
            return sum(not self.admission.is_reserved(r) for r in list(self._waiting))
        except RuntimeError:
            return 0

    def _schedule_prefill(self) -> tuple[list[str], dict[str, tuple[int, int]]]:
        """The prefill of this step: (request ids, their prompt ranges [start, end))."""
        budget = self.prefill_chunk_tokens
        prefill_ids, chunks = [], {}
        for request_id in list(self._waiting):
            if budget is not None and budget <= 0:
                break
            request = self.requests[request_id]
            if self.admission is not None and not self.admission.is_reserved(request_id):
                if self.admission.try_reserve(request) is not None and not faults.active(
                        "scheduler.admission_ignores_memory"):
                    break  # first come first served: the head waits for memory, so do those behind it
            start = self._prefilled[request_id]
            prompt_len = request.stats.num_prompt_tokens
            end = prompt_len if budget is None else min(prompt_len, start + budget)
            if budget is not None:
                budget -= end - start
            prefill_ids.append(request_id)
            chunks[request_id] = (start, end)
            self._prefilled[request_id] = end
            if end == prompt_len:  # its last chunk: it samples its first token this step
                self._waiting.remove(request_id)
                del self._prefilled[request_id]
        return prefill_ids, chunks

    def schedule(self) -> SchedulerOutput:
        prefill_ids, prefill_chunks = self._schedule_prefill()
        running = [r for r in self.requests.values() if r.status == RequestStatus.RUNNING]
        speculative = [r for r in running if r.speculative]
        target_only = [r.request_id for r in running if not r.speculative]
        draft_rows: dict[str, int] = {}
        riders_apart = False
        if running:
            self.slot_refills.on_step()
        if self.policy is not None and speculative:
            # a quiet step that only counts is known from the roster alone (no plan inputs built)
            roster = (tuple(r.request_id for r in speculative), len(target_only))
            if not self.policy.continues_quiet_stretch(roster):
                remaining = {r.request_id: r.params.max_new_tokens - r.stats.num_output_tokens for r in running}
                # rows past the request's remaining output could never be emitted
                candidates = {r.request_id: min(self.policy.num_rows, remaining[r.request_id] - 1) for r in speculative}
                sampled = frozenset(r.request_id for r in speculative if not r.params.is_greedy)
                plan = self.policy.plan(candidates, num_target_only=len(target_only), sampled=sampled,
                                        remaining=remaining, refill_share=self._refill_share(), roster=roster)
                draft_rows, riders_apart = plan.draft_rows, plan.riders_apart
            target_only = [r.request_id for r in speculative if r.request_id not in draft_rows] + target_only
            speculative = [r for r in speculative if r.request_id in draft_rows]
        output = SchedulerOutput(
            prefill_ids=prefill_ids,
            speculative_ids=[r.request_id for r in speculative],
            target_only_ids=target_only,
            finished_ids=self.take_finished_ids(),
            draft_rows=draft_rows,
            prefill_chunks=prefill_chunks,
            riders_apart=riders_apart,
        )
        return output

    def _refill_share(self) -> float:
        if faults.active("scheduler.refills_unmeasured"):
            return 1.0
        return self.slot_refills.share

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestEvent]:
        if self.policy is not None:
            self._observe(scheduler_output, runner_output)
        events = []
        for request_id in runner_output.draft_demoted:  # the draft pool could not extend it: target-only now
            request = self.requests.get(request_id)
            if request is not None:
                request.speculative = False
        for request_id, error in runner_output.failed.items():
            events += self.finish_requests([request_id], RequestStatus.FINISHED_ERROR, error)
        for request_id, token_ids in runner_output.new_token_ids.items():
            request = self.requests.get(request_id)
            if request is None:  # cancelled while the step ran
                continue
            if request.status == RequestStatus.WAITING:
                request.status = RequestStatus.RUNNING
            if request_id in runner_output.accepted_len and request.stats.spec is not None:
                num_verified = runner_output.num_verified.get(request_id, request.stats.spec.num_draft_slots)
                request.stats.spec.observe_draft(num_verified, runner_output.accepted_len[request_id])
            release = request.append_committed(token_ids)
            if release.status is not None:
                self._finish(request, release.status)
            events.append(RequestEvent(request, release))
        return events

    def _observe(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> None:
        """Feed the policy this step's acceptance and, unless a request failed (a retried stage
        times more than one forward), its stage costs."""
        for request_id, accepted in runner_output.accepted_len.items():
            if request_id not in self.requests:  # cancelled while the step ran: forgotten already
                continue
            verified = runner_output.num_verified.get(request_id, 0)
            # Against the rows planned, not those verified: a row the confidence cut dropped is a row
            # the plan paid for that committed nothing, and the forecast of the next plan must see
            # it (observed against the verified rows only, the forecasts of one request at 0.7 ran
            # 40% above what its planned steps accepted).
            planned = scheduler_output.draft_rows.get(request_id, verified)
            if faults.active("policy.acceptance_against_verified_rows"):
                planned = verified
            self.policy.observe_cycle(request_id, max(planned, verified), accepted)
        if runner_output.failed:
            return
        times = runner_output.stage_times
        if scheduler_output.target_only_ids and times.target_step > 0:
            self.policy.costs.observe_target_step(len(scheduler_output.target_only_ids), times.target_step)
        verified = [runner_output.num_verified[r] for r in scheduler_output.speculative_ids
                    if r in runner_output.num_verified]
        if verified and times.verify > 0:
            # the target-only requests rode in the verify forward (model_runner), which pads every
            # request to the longest one's rows, unless they ran apart (their own target step above)
            batch = len(verified) + (0 if scheduler_output.riders_apart else len(scheduler_output.target_only_ids))
            rows = self.policy.costs.verify_rows(batch, verified)
            # the drafter and the tail ran every drafting request over the step's block rows
            self.policy.costs.observe_speculative(len(verified) * runner_output.block_rows, rows, times.verify,
                                                  times.draft + times.tail + times.commit)

    def finish_requests(self, request_ids: list[str], status: RequestStatus, error: str | None = None) -> list[RequestEvent]:
        events = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.error = error
            self._finish(request, status)
            events.append(RequestEvent(request, Release([], "", status)))
        return events

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        del self.requests[request.request_id]
        self.slot_refills.on_finish(len(self.requests))
        if self.policy is not None:
            self.policy.forget(request.request_id)
        if request.request_id in self._waiting:
            self._waiting.remove(request.request_id)
        self._prefilled.pop(request.request_id, None)
        if self.admission is not None:
            self.admission.unreserve(request.request_id)
        self._to_free.append(request.request_id)
