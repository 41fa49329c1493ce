"""The model runner: owns every device tensor of the engine and runs one step.

Per request it holds the target state (K/V, GDN conv/recurrent state), its
draft KV pool slots and its random generator. A step is: free finished
requests, prefill new ones, one speculative cycle for the speculative batch
(draft -> tail -> verify -> commit), one target-only token for the rest.

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

from . import decoding, sampling, verify
from .config import EngineConfig
from .request import Request
from .step_stats import StageInterval
from .types import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, target, drafter, tail_tables, draft_pool, config: EngineConfig, device: torch.device,
                 target_kv_pool=None):
        self.target = target
        self.target_kv_pool = target_kv_pool  # PagedKVPool (paged layout) or None (contiguous)
        self.drafter = drafter
        self.tail_tables = tail_tables
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
        # request_id -> features [1, F, H] of committed positions not yet in its draft context
        self._deferred_context: dict[str, list[torch.Tensor]] = {}
        self._prefill_chunks: dict[str, tuple[int, int]] = {}  # this step's (SchedulerOutput.prefill_chunks)
        self._demoted: set[str] = set()  # speculative requests the draft pool could not extend
        self._verified_logits: torch.Tensor | None = None  # this cycle's processed target logits (logprobs)

    # ------------------------------------------------------------------ step
    def execute(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> RunnerOutput:
        """Run one step for the scheduled requests; never raises for a per-request failure."""
        out = RunnerOutput.make_empty()
        self._draft_rows = scheduler_output.draft_rows
        self._prefill_chunks = scheduler_output.prefill_chunks
        self.free(scheduler_output.finished_ids)
        if scheduler_output.prefill_ids:
            self._isolated(self._prefill, scheduler_output.prefill_ids, requests, out)
        speculative_ids, target_only_ids = scheduler_output.speculative_ids, scheduler_output.target_only_ids
        if speculative_ids:
            speculative_ids = self._fit_speculative(speculative_ids, out)
            target_only_ids = [r for r in scheduler_output.speculative_ids if r not in speculative_ids] + target_only_ids
        self._drafting = frozenset(speculative_ids)
        if speculative_ids:
            # The step's target-only requests ride in the cycle's verify forward, one row each: one
            # forward per step instead of two (a forward's fixed cost is most of a decode step's).
            self._isolated(self._speculative_cycle, speculative_ids + target_only_ids, requests, out)
        elif target_only_ids:
            self._isolated(self._target_step, target_only_ids, requests, out)
        if self.draft_pool is not None:
            out.draft_pool_used = self.draft_pool.used
        return out

    def free(self, request_ids: list[str]) -> None:
        """Drop the target state, draft slots and generator of finished requests."""
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                state.release()
            self.generators.pop(request_id, None)
            self._deferred_context.pop(request_id, None)
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
        self.free([request_id])

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

    # --------------------------------------------------------------- prefill
    @torch.inference_mode()
    def _prefill(self, request_ids: list[str], requests: dict[str, Request], out: RunnerOutput) -> None:
        """Prefill this step's prompt ranges (``SchedulerOutput.prefill_chunks``; whole prompts without).

        Forwards are grouped so that rows x padded length stays within ``prefill_chunk_tokens``
        (one long chunk runs alone): activation memory never exceeds one chunk's. Only a request's
        last chunk computes logits, for its last position only. Idempotent per request (a retry
        after a failure skips ranges already committed)."""
        self._fault("prefill", request_ids)
        chunks = {}
        for request_id in request_ids:
            prompt_len = len(requests[request_id].prompt_token_ids)
            chunks[request_id] = self._prefill_chunks.get(request_id, (0, prompt_len))
        with self._timed(out, "prefill", request_ids):
            for request_id in request_ids:
                if request_id not in self.states:
                    request = requests[request_id]
                    self.states[request_id] = self.target.new_state(
                        device=self.device, dtype=self.target_dtype, kv_pool=self.target_kv_pool, request_id=request_id)
                    self.generators[request_id] = sampling.make_generator(request.params.seed, self.device)
            todo = [r for r in request_ids if self.states[r].num_tokens < chunks[r][1]]
            budget = self.config.prefill_chunk_tokens
            group: list[str] = []
            for request_id in todo:
                longest = max([chunks[r][1] - chunks[r][0] for r in group + [request_id]])
                if group and (len(group) + 1) * longest > budget:
                    self._prefill_group(group, requests, chunks, out)
                    group = []
                group.append(request_id)
            if group:
                self._prefill_group(group, requests, chunks, out)

    def _prefill_group(self, request_ids: list[str], requests: dict[str, Request],
                       chunks: dict[str, tuple[int, int]], out: RunnerOutput) -> None:
        batch = [requests[r] for r in request_ids]
        states = [self.states[r] for r in request_ids]
        ranges = [chunks[r] for r in request_ids]
        prompts = [torch.tensor(r.prompt_token_ids[a:b], dtype=torch.long, device=self.device)
                   for r, (a, b) in zip(batch, ranges)]
        last = [b == len(r.prompt_token_ids) for r, (_, b) in zip(batch, ranges)]
        wants_features = any(r.speculative for r in batch)
        result = self.target.forward_step(prompts, states, feature_layers=self.feature_layers if wants_features else (),
                                          logits="last" if any(last) else "none")
        lengths = [len(p) for p in prompts]
        self.target.commit(states, lengths)
        for b, request in enumerate(batch):
            if request.speculative and request.request_id not in self._demoted:
                if not self.draft_pool.has_request(request.request_id):
                    self.draft_pool.alloc_request(request.request_id)
                if not self.draft_pool.can_append([request.request_id], [lengths[b]]) and not faults.active(
                        "runner.no_draft_pool_fallback"):
                    self._demote(request.request_id, out)
                    continue
                if faults.active("runner.chunk_features_dropped") and not last[b]:
                    continue
                self.drafter.append_context(self.draft_pool, [request.request_id], [result.features[b, : lengths[b]]])
        finishing = [b for b in range(len(batch)) if last[b]]
        if finishing:
            first_tokens = self._sample(result.logits[finishing, 0], [batch[b] for b in finishing], out)
            for b, token in zip(finishing, first_tokens):
                out.new_token_ids[batch[b].request_id] = [token]

    def _demote(self, request_id: str, out: RunnerOutput) -> None:
        """The draft pool cannot extend this request: free its draft context; it decodes target-only
        (the scheduler marks it so), which emits exactly what speculation would have."""
        logger.warning("request %s: draft KV pool full; decoding target-only from here", request_id)
        if self.draft_pool.has_request(request_id):
            self.draft_pool.free_request(request_id)
        self._deferred_context.pop(request_id, None)
        self._demoted.add(request_id)
        out.draft_demoted.append(request_id)

    def _fit_speculative(self, request_ids: list[str], out: RunnerOutput) -> list[str]:
        """The speculative requests whose commit (at most a block, plus deferred positions) the draft
        pool can take this step, together; the others are demoted to target-only before drafting."""
        if faults.active("runner.no_draft_pool_fallback"):
            return request_ids
        block = self.drafter.args.block_size
        fit: list[str] = []
        counts: list[int] = []
        for request_id in request_ids:
            # a commit appends accepted + 1 <= verified rows + 1 positions, after the deferred ones
            rows = min(block, self._draft_rows.get(request_id, block - 1) + 1)
            need = rows + sum(f.shape[0] for f in self._deferred_context.get(request_id, []))
            if self.draft_pool.can_append(fit + [request_id], counts + [need]):
                fit.append(request_id)
                counts.append(need)
            else:
                self._demote(request_id, out)
        return fit

    # ----------------------------------------------------- target-only decode
    @torch.inference_mode()
    def _target_step(self, request_ids: list[str], requests: dict[str, Request], out: RunnerOutput) -> None:
        self._fault("target_step", request_ids)
        batch = [requests[r] for r in request_ids]
        with self._timed(out, "target_step", request_ids):
            states = [self.states[r] for r in request_ids]
            inputs = torch.tensor([[r.pending_token_id] for r in batch], dtype=torch.long, device=self.device)
            # A speculative request decoding target-only this step (adaptive speculation) keeps the
            # features of the position for its drafter: they are appended to its draft context in
            # one batch when it next drafts (appending one position per step would cost a drafter
            # pass per token), or once a window's worth has piled up.
            drafting = [b for b, r in enumerate(batch) if self._drafts(r)]
            result = self.target.forward_step(inputs, states, feature_layers=self.feature_layers if drafting else ())
            self.target.commit(states, [1] * len(batch))
            tokens = self._sample(result.logits[:, 0], batch, out)
            self._defer_context(request_ids, drafting, result.features)
        for request, token in zip(batch, tokens):
            out.new_token_ids[request.request_id] = [token]

    def _drafts(self, request: Request) -> bool:
        """Whether the request has a draft context to keep up to date."""
        return request.speculative and self.draft_pool is not None and self.draft_pool.has_request(request.request_id)

    def _defer_context(self, request_ids: list[str], rows: list[int], features: torch.Tensor) -> None:
        """Keep row 0's features of ``rows`` (indices into ``request_ids``) for their draft contexts."""
        # features: [N, T, F]; called last in a stage, so a retried stage never keeps a position twice
        for b in rows:
            self._deferred_context.setdefault(request_ids[b], []).append(features[b, :1].clone())
        self._flush_context([request_ids[b] for b in rows
                             if len(self._deferred_context[request_ids[b]]) >= self.drafter.args.window])

    # ------------------------------------------------------ speculative cycle
    @torch.inference_mode()
    def _speculative_cycle(self, request_ids: list[str], requests: dict[str, Request], out: RunnerOutput) -> None:
        """One cycle for the step's drafting requests; the others in ``request_ids`` ride in its
        verify forward with one row (their pending token) and sample one token as a target step."""
        rider_ids = [r for r in request_ids if r not in self._drafting]
        request_ids = [r for r in request_ids if r in self._drafting]
        if not request_ids:  # a rider retried alone (see _isolated)
            self._target_step(rider_ids, requests, out)
            return
        batch = [requests[r] for r in request_ids]
        riders = [requests[r] for r in rider_ids]
        params = [r.params for r in batch]
        generators = [self.generators[r] for r in request_ids]
        anchors = torch.tensor([r.pending_token_id for r in batch], dtype=torch.long, device=self.device)

        with self._timed(out, "draft", request_ids):
            self._fault("draft", request_ids)
            self._flush_context(request_ids)
            draft_out = self.drafter.draft(self.draft_pool, request_ids, anchors)
        with self._timed(out, "tail", request_ids):
            self._fault("tail", request_ids)
            proposal = self.propose(request_ids, requests, draft_out, anchors, params, generators)
        with self._timed(out, "verify", request_ids):
            self._fault("verify", request_ids)
            if rider_ids:
                self._fault("target_step", rider_ids)
            states = [self.states[r] for r in request_ids + rider_ids]
            num_verified = self._verify_lengths(proposal, request_ids)  # [NB] draft tokens each request verifies
            block = torch.cat([anchors[:, None], proposal.draft_ids], dim=1)  # [NB, BS]
            lengths = num_verified.tolist()
            if min(lengths) == max(lengths) and not riders:
                rows = block[:, : lengths[0] + 1]
            else:  # forward_step pads internally; no request's state ever sees the padding
                rows = [block[b, : n + 1] for b, n in enumerate(lengths)]
                rows += [torch.tensor([r.pending_token_id], dtype=torch.long, device=self.device) for r in riders]
            result = self.target.forward_step(rows, states, feature_layers=self.feature_layers)
            nb = len(batch)
            # logits: [NB + NR, T, V]; T = 1 + max(lengths), a rider's row 0 is its real row
            verdict = self._verify(proposal, result.logits[:nb], batch, generators, num_verified)
            rider_tokens = self._sample(result.logits[nb:, 0], riders, out) if riders else []
        if riders:
            # The riders' target step is the same forward: their own interval, not engine time twice.
            verify_interval = out.stage_intervals[-1]
            out.stage_intervals.append(StageInterval("target_step", verify_interval.start, verify_interval.end,
                                                     tuple(rider_ids)))
        with self._timed(out, "commit", request_ids):
            self._fault("commit", request_ids)
            accepted = verdict.accepted_len.tolist()
            self.target.commit(states, [a + 1 for a in accepted] + [1] * len(riders))
            self.drafter.append_context(
                self.draft_pool, request_ids, [result.features[b, : accepted[b] + 1] for b in range(nb)]
            )
            tokens = verdict.output_ids.tolist()
            self._defer_context(request_ids + rider_ids, [nb + i for i, r in enumerate(riders) if self._drafts(r)],
                                result.features)
            if decoding.wants_logprobs(batch):  # row i of the verified logits scored emitted token i
                out.new_logprobs.update(decoding.token_logprobs(
                    self._verified_logits, batch, [tokens[b][: accepted[b] + 1] for b in range(len(batch))]))
            self._verified_logits = None
        for b, request in enumerate(batch):
            emitted = tokens[b][: accepted[b] + 1]
            out.new_token_ids[request.request_id] = emitted
            out.accepted_len[request.request_id] = accepted[b]
            out.num_verified[request.request_id] = lengths[b]
            request.stats.peak_draft_pool_slots = max(
                request.stats.peak_draft_pool_slots, self.draft_pool.request_len(request.request_id)
            )
        for request, token in zip(riders, rider_tokens):
            out.new_token_ids[request.request_id] = [token]

    def _flush_context(self, request_ids: list[str]) -> None:
        """Append the deferred positions of these requests to their draft contexts (one drafter pass)."""
        pending = [(r, self._deferred_context.pop(r)) for r in request_ids if r in self._deferred_context]
        if pending:
            self.drafter.append_context(self.draft_pool, [r for r, _ in pending],
                                        [torch.cat(features) for _, features in pending])

    def propose(self, request_ids, requests, draft_out, anchors, params, generators):
        """The tail's proposal for the batch; tests replace this to force acceptance patterns."""
        from . import tail

        if any(p.is_gumbel for p in params):  # seed-reproducible requests propose with the target's noise
            return decoding.propose(draft_out, self.tail_tables, anchors, [requests[r] for r in request_ids],
                                    generators, with_confidence=self.config.verify_threshold > 0)
        temperature, top_k, top_p = sampling.batch_params(params, device=self.device)
        return tail.propose(draft_out, self.tail_tables, anchors, temperature, top_k, top_p, generators,
                            with_confidence=self.config.verify_threshold > 0)

    def _verify_lengths(self, proposal, request_ids: list[str]) -> torch.Tensor:
        """[NB] int64: draft rows each request verifies: the step's plan, cut further by the
        confidence threshold (the whole block without either)."""
        from . import tail

        nb, num_draft = proposal.draft_ids.shape
        if proposal.confidence is None:
            lengths = torch.full((nb,), num_draft, dtype=torch.int64, device=proposal.draft_ids.device)
        else:
            lengths = tail.verify_lengths(proposal.confidence, self.config.verify_threshold)
        if self._draft_rows:
            planned = [self._draft_rows.get(r, num_draft) for r in request_ids]
            lengths = torch.minimum(lengths, torch.tensor(planned, dtype=torch.int64, device=lengths.device))
        return lengths

    def _verify(self, proposal, target_logits: torch.Tensor, batch: list[Request], generators,
                num_verified: torch.Tensor):
        # target_logits: [NB, T, V], T = 1 + max(num_verified); p is built by the same filtering as
        # target-only sampling. Draft rows past T - 1 were not verified by anyone.
        num_draft = proposal.draft_ids.shape[1]
        nb, bs, vocab = target_logits.shape
        verified = bs - 1
        draft_ids = proposal.draft_ids[:, :verified]
        ragged = num_verified if bool((num_verified != verified).any()) else None
        # logit bias and penalties; row t also counts the drafted y_1 .. y_t (logits_processors)
        target_logits = decoding.processed_logits(target_logits, batch, draft_ids)
        self._verified_logits = target_logits
        if all(r.params.is_greedy for r in batch):
            return verify.verify_greedy(draft_ids, target_logits, num_draft=ragged)
        greedy = torch.tensor([r.params.is_greedy for r in batch], device=self.device)
        temperature, top_k, top_p = self._param_tensors(batch)
        if faults.active("runner.p_without_temperature"):
            temperature = torch.where(temperature > 0, 1.0, temperature)
        if faults.active("runner.p_without_top_p"):
            top_p = torch.ones_like(top_p)
        min_p = sampling.batch_min_p([r.params for r in batch], device=self.device)
        target_probs = sampling.probabilities(
            target_logits.reshape(nb * bs, vocab),
            temperature.repeat_interleave(bs), top_k.repeat_interleave(bs), top_p.repeat_interleave(bs),
            min_p=min_p.repeat_interleave(bs),
        ).reshape(nb, bs, vocab)
        # seed-reproducible requests: exact match against the target's Gumbel-argmax of every row
        target_probs, gumbel_rows = decoding.gumbel_verify_targets(target_probs, target_logits, batch)
        greedy = greedy | gumbel_rows
        # A fixed number of coins per request per cycle keeps each request's random stream
        # independent of acceptance and of its neighbours.
        coins = sampling.draw_uniforms(generators, num_draft + 1, device=self.device)  # [NB, BS]
        return verify.verify_sampled(
            draft_ids, proposal.q[:, :verified], target_probs, coins[:, :verified], coins[:, num_draft],
            draft_q_ids=proposal.cand_ids[:, :verified], greedy=greedy, num_draft=ragged,
        )

    # --------------------------------------------------------------- helpers
    @property
    def target_dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    def _param_tensors(self, batch: list[Request]):
        return sampling.batch_params([r.params for r in batch], device=self.device)

    def _sample(self, logits: torch.Tensor, batch: list[Request], out: RunnerOutput | None = None) -> list[int]:
        """One token per row from the target distribution after each request's processing and filtering
        (and its logprobs into ``out`` when asked)."""
        # logits: [N, V]
        logits = decoding.processed_logits(logits[:, None], batch)[:, 0]  # logit bias and penalties
        tokens = self._choose(logits, batch)
        if out is not None and decoding.wants_logprobs(batch):
            out.new_logprobs.update(decoding.token_logprobs(logits[:, None], batch, [[t] for t in tokens]))
        return tokens

    def _choose(self, logits: torch.Tensor, batch: list[Request]) -> list[int]:
        # logits: [N, V], processed
        if all(r.params.is_greedy for r in batch):
            return logits.argmax(dim=-1).tolist()
        temperature, top_k, top_p = self._param_tensors(batch)
        min_p = sampling.batch_min_p([r.params for r in batch], device=self.device)
        probs = sampling.probabilities(logits, temperature, top_k, top_p, min_p=min_p)
        uniforms = sampling.draw_uniforms([self.generators[r.request_id] for r in batch], 1, device=self.device)[:, 0]
        tokens = sampling.sample(probs, uniforms)
        if any(r.params.is_gumbel for r in batch):  # seed-reproducible rows: Gumbel-argmax at their position
            is_gumbel = torch.tensor([r.params.is_gumbel for r in batch], device=self.device)
            tokens = torch.where(is_gumbel, decoding.gumbel_tokens(logits, batch), tokens)
        return tokens.tolist()
