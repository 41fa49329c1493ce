"""The model runner's prefill: prompt ranges in token-budgeted groups, then the first token.

Mixin of :class:`~dspine.replica.model_runner.ModelRunner` (reads its ``target``, ``states``,
``draft_pool``, ``drafter``, ``config`` and the step's ``_prefill_chunks``; records each request's
drafter in ``_request_drafter``).
"""

from __future__ import annotations

import torch

from dspine import faults

from . import sampling
from .request import Request
from .types import RunnerOutput


class RunnerPrefill:
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
                    if request.drafter:
                        self._request_drafter[request_id] = request.drafter
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
                # kept until the request first drafts (see runner_draft_context): one the adaptive
                # policy never lets draft never runs its drafter over the prompt
                self._defer_positions(request.request_id, result.features[b, : lengths[b]])
        finishing = [b for b in range(len(batch)) if last[b]]
        if finishing:
            first_tokens = self._sample(result.logits[finishing, 0], [batch[b] for b in finishing], out)
            for b, token in zip(finishing, first_tokens):
                out.new_token_ids[batch[b].request_id] = [token]
