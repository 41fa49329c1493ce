"""The drafter's context in the draft KV pool, kept by the model runner.

A speculative request's committed positions reach its draft context: at once after a cycle, or
deferred while it decodes target-only (appended in one drafter pass when it next drafts, or once
a window's worth has piled up). When the pool cannot take a request's next positions it is
demoted to target-only (which emits exactly what speculation would have). Mixin of
:class:`~dspine.replica.model_runner.ModelRunner`.
"""

from __future__ import annotations

import logging

import torch

from dspine import faults

from .request import Request
from .types import RunnerOutput

logger = logging.getLogger("dspine.replica.model_runner")


class RunnerDraftContext:
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


    def _flush_context(self, request_ids: list[str]) -> None:
        """Append the deferred positions of these requests to their draft contexts (one drafter pass)."""
        pending = [(r, self._deferred_context.pop(r)) for r in request_ids if r in self._deferred_context]
        if pending:
            self._append_context([r for r, _ in pending], [torch.cat(features) for _, features in pending])
