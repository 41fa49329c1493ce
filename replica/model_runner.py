"""The model runner: owns every device tensor of the engine and runs one step.

Per request it holds the target state (K/V, GDN conv/recurrent state), its
draft KV pool slots and its random generator. A step is: free finished
requests, prefill new ones, one speculative cycle for the speculative batch
(draft -> tail -> verify -> commit), one target-only token for the rest.
Each stage lives beside this file as a mixin: runner_prefill.py, runner_speculative.py,
runner_target_step.py (and the one sampling path), runner_draft_context.py (the drafter's
context, deferral and demotion); this file is the step itself, failure isolation, stage
timing and the per-request state.

A failure inside a batch is retried request by request, so only the request
that fails again is ended; its pending target positions are dropped and its
slots freed.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable

import torch

from dspine import faults

from .config import EngineConfig
from .drafters import GREEDY, SAMPLED, LoadedDrafter
from .request import Request
from .runner_draft_context import RunnerDraftContext
from .runner_drafters import RunnerDrafters
from .runner_prefill import RunnerPrefill
from .runner_speculative import RunnerSpeculative
from .runner_target_step import RunnerTargetStep
from .step_stats import StageInterval
from .types import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner(RunnerPrefill, RunnerSpeculative, RunnerTargetStep, RunnerDraftContext, RunnerDrafters):
    """Owns the engine's device state; ``execute`` runs one step. Touched on the device thread only."""

    def __init__(self, target, drafter, tail_tables, draft_pool, config: EngineConfig, device: torch.device,
                 target_kv_pool=None, sampled_drafter=None, sampled_tail_tables=None):
        self.target = target
        self.target_kv_pool = target_kv_pool  # PagedKVPool (paged layout) or None (contiguous)
        self.drafter = drafter  # the greedy drafter (the only one of a one-drafter engine)
        self.tail_tables = tail_tables
        # name -> LoadedDrafter (replica/drafters.py); both share draft_pool (same geometry)
        self.drafters: dict[str, LoadedDrafter] = {}
        if drafter is not None:
            self.drafters[GREEDY] = LoadedDrafter(GREEDY, drafter, tail_tables)
            if sampled_drafter is not None:
                self.drafters[SAMPLED] = LoadedDrafter(SAMPLED, sampled_drafter, sampled_tail_tables)
        self._request_drafter: dict[str, str] = {}  # request_id -> drafter name (two drafters only read it)
        self.draft_pool = draft_pool
        self.config = config
        self.device = device
        self.feature_layers = tuple(drafter.args.feature_layers) if drafter is not None else ()
        self.states: dict = {}  # request_id -> TargetState
        self.generators: dict[str, torch.Generator] = {}
        # Test hook: called with the request ids of each stage; raising inside simulates a failure.
        self.fault_hook: Callable[[str, list[str]], None] | None = None
        # Synchronise the device around each stage so its interval is device time (CUDA only;
        # off unless tracing or profiling asks: an untraced engine pays nothing for timing).
        self.precise_timing = False
        self._draft_rows: dict[str, int] = {}  # this step's plan (SchedulerOutput.draft_rows)
        self._drafting: frozenset[str] = frozenset()  # this step's SchedulerOutput.speculative_ids
        # request_id -> features [T, F, H] of committed positions not yet in its draft context, or
        # (a target-only step's features [N, 1, F, H], the request's row b) (runner_draft_context.py)
        self._deferred_context: dict[str, list[torch.Tensor | tuple[torch.Tensor, int]]] = {}
        self._deferred_count: dict[str, int] = {}  # positions in _deferred_context, per request
        self._prefill_chunks: dict[str, tuple[int, int]] = {}  # this step's (SchedulerOutput.prefill_chunks)
        self._demoted: set[str] = set()  # speculative requests the draft pool could not extend
        self._verified_logits: torch.Tensor | None = None  # this cycle's processed target logits (logprobs)

    # ------------------------------------------------------------------ step
    def execute(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> RunnerOutput:
        """Run one step for the scheduled requests; never raises for a per-request failure."""
        out = RunnerOutput.make_empty()
        self._draft_rows = scheduler_output.draft_rows
        self._prefill_chunks = scheduler_output.prefill_chunks
        self.free_requests(scheduler_output.finished_ids)
        if scheduler_output.prefill_ids:
            self._isolated(self._prefill, scheduler_output.prefill_ids, requests, out)
        speculative_ids, target_only_ids = scheduler_output.speculative_ids, scheduler_output.target_only_ids
        if speculative_ids:
            speculative_ids = self._fit_speculative(speculative_ids, out)
            target_only_ids = [r for r in scheduler_output.speculative_ids if r not in speculative_ids] + target_only_ids
        self._drafting = frozenset(speculative_ids)
        if speculative_ids and scheduler_output.riders_apart and not faults.active("runner.riders_apart_ignored"):
            # The plan found the riders' padding dearer than a forward of their own (CostModel.step_cost).
            self._isolated(self._speculative_cycle, speculative_ids, requests, out)
            if target_only_ids:
                self._isolated(self._target_step, target_only_ids, requests, out)
        elif speculative_ids:
            # The step's target-only requests ride in the cycle's verify forward, one row each: one
            # forward per step instead of two (a forward's fixed cost is most of a decode step's).
            self._isolated(self._speculative_cycle, speculative_ids + target_only_ids, requests, out)
        elif target_only_ids:
            self._isolated(self._target_step, target_only_ids, requests, out)
        if self.draft_pool is not None:
            out.draft_pool_used = self.draft_pool.used
        return out

    def free_requests(self, request_ids: list[str]) -> None:
        """Free the target state, draft slots and generator of finished requests (idempotent)."""
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                state.free()
            self.generators.pop(request_id, None)
            self._deferred_context.pop(request_id, None)
            self._deferred_count.pop(request_id, None)
            self._request_drafter.pop(request_id, None)
            self._demoted.discard(request_id)
            if self.draft_pool is not None and self.draft_pool.has_request(request_id):
                self.draft_pool.free_request(request_id)

    def target_kv_free_tokens(self) -> int | None:
        """Positions the target's paged K/V pool can still take (free blocks x block size);
        None for the contiguous layout (no fixed capacity)."""
        pool = self.target_kv_pool
        return None if pool is None else pool.num_free_blocks * pool.block_size

    def target_kv_used_blocks(self) -> int:
        """Blocks of the target's K/V pool held by requests (zero when idle: the leak check)."""
        return 0 if self.target_kv_pool is None else self.target_kv_pool.used

    @property
    def num_live_states(self) -> int:
        return len(self.states)

    def num_deferred_positions(self) -> int:
        """Committed positions kept for draft contexts, not yet appended (runner_draft_context)."""
        return sum(self._deferred_count.values())

    def target_tokens_in_use(self) -> int:
        """Positions held by live target states (a snapshot; read off the device thread too)."""
        try:
            return sum(s.num_tokens + s.num_pending for s in list(self.states.values()))
        except RuntimeError:  # the dict changed under the read: one step's staleness is fine
            return 0

    def _isolated(self, stage, request_ids: list[str], requests: dict[str, Request], out: RunnerOutput) -> None:
        try:
            stage(request_ids, requests, out)
            return
        except Exception:  # noqa: BLE001 - isolate below, one request at a time
            if len(request_ids) == 1:
                self._fail(request_ids[0], out)
                return
            self._rollback(request_ids)
        for request_id in request_ids:
            try:
                stage([request_id], requests, out)
            except Exception:  # noqa: BLE001 - this request alone fails
                self._fail(request_id, out)

    def _fail(self, request_id: str, out: RunnerOutput) -> None:
        import traceback

        error = traceback.format_exc(limit=3)
        logger.error("request %s failed:\n%s", request_id, error)
        out.failed[request_id] = error.strip().splitlines()[-1]
        out.new_token_ids.pop(request_id, None)
        out.new_logprobs.pop(request_id, None)
        self._rollback([request_id])
        self.free_requests([request_id])

    def _rollback(self, request_ids: list[str]) -> None:
        states = [self.states[r] for r in request_ids if r in self.states]
        if states:
            self.target.commit(states, [0] * len(states))

    def _fault(self, stage: str, request_ids: list[str]) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage, request_ids)

    @contextmanager
    def _timed(self, out: RunnerOutput, name: str, request_ids: list[str]):
        """Record the stage's wall interval and who took part (see step_stats)."""
        sync = self.precise_timing and self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                torch.cuda.synchronize(self.device)
            end = time.perf_counter()
            setattr(out.stage_times, name, getattr(out.stage_times, name) + end - start)
            out.stage_intervals.append(StageInterval(name, start, end, tuple(request_ids)))
