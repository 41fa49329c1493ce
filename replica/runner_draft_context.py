"""The drafter's context in the draft KV pool, kept by the model runner.

A speculative request's committed positions reach its draft context: at once after a cycle, or
deferred, from its prompt and while it decodes target-only, until it next drafts (then appended in
one drafter pass) or :data:`MAX_DEFERRED_POSITIONS` have piled up. A request the adaptive policy
never lets draft never pays a drafter pass, not even over its prompt (with 8 requests in flight
that pass cost 1-2% of their decode time). When the pool cannot take a request's next positions it is
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

# Deferred positions a request keeps at most before they go to its draft context (fewer when the
# drafter's window is shorter): the features of 256 positions of the 27B target's five taps are
# 13 MiB in bf16, and a pass over that many positions costs little more per position than a
# prompt's.
MAX_DEFERRED_POSITIONS = 256


class RunnerDraftContext:
    def _demote(self, request_id: str, out: RunnerOutput) -> None:
        """The draft pool cannot extend this request: free its draft context; it decodes target-only
        (the scheduler marks it so), which emits exactly what speculation would have."""
        logger.warning("request %s: draft KV pool full; decoding target-only from here", request_id)
        if self.draft_pool.has_request(request_id):
            self.draft_pool.free_request(request_id)
        self._deferred_context.pop(request_id, None)
        self._deferred_count.pop(request_id, None)
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
            need = rows + self._num_deferred(request_id)
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
        # features: [N, T, F, H]; called last in a stage, so a retried stage never keeps a position twice.
        # A target-only step's features ([N, 1, F, H], fresh from the forward, never written to) are
        # kept as one reference per request, (features, b), sliced only if the position reaches a
        # draft context (a request that finishes without drafting never pays for it): a copy or even
        # a view per request and step was 30 us of a 10.6 ms step of 8 requests on a 2-core CPU. A
        # verify keeps only row 0 of its padded rows, so its features are copied (a reference would
        # hold all of them alive).
        if not rows:
            return
        if faults.active("runner.context_appended_at_once"):
            for b in rows:
                self._append_context([request_ids[b]], [features[b, :1]])
            return
        copy = features.shape[1] > 1
        limit = min(MAX_DEFERRED_POSITIONS, self.drafter.args.window)
        deferred, counts = self._deferred_context, self._deferred_count
        full = []
        for b in rows:
            request_id = request_ids[b]
            kept = deferred.get(request_id)
            if kept is None:
                kept = deferred[request_id] = []
            kept.append(features[b, :1].clone() if copy else (features, b))
            counts[request_id] = count = counts.get(request_id, 0) + 1
            if count >= limit:
                full.append(request_id)
        if full:
            self._flush_context(full)

    def _defer_positions(self, request_id: str, features: torch.Tensor, copy: bool = True) -> None:
        """Keep ``features`` [T, F, H] (the request's next committed positions) for its draft context
        (a copy unless ``copy`` is False: a view of a tensor nobody writes to, no larger than it);
        append what has piled up once it reaches :data:`MAX_DEFERRED_POSITIONS` (or the window)."""
        if faults.active("runner.context_appended_at_once"):
            self._append_context([request_id], [features])
            return
        kept = self._deferred_context.setdefault(request_id, [])
        kept.append(features.clone() if copy else features)
        self._deferred_count[request_id] = self._deferred_count.get(request_id, 0) + int(features.shape[0])
        if self._deferred_count[request_id] >= min(MAX_DEFERRED_POSITIONS, self.drafter.args.window):
            self._flush_context([request_id])

    def _num_deferred(self, request_id: str) -> int:
        return self._deferred_count.get(request_id, 0)


    def _flush_context(self, request_ids: list[str]) -> None:
        """Append the deferred positions of these requests to their draft contexts (one drafter pass)."""
        pending = [(r, self._deferred_context.pop(r)) for r in request_ids if r in self._deferred_context]
        for request_id, _ in pending:
            self._deferred_count.pop(request_id, None)
        if pending:
            self._append_context([r for r, _ in pending], [torch.cat([_positions(kept) for kept in features])
                                                           for _, features in pending])


def _positions(kept: torch.Tensor | tuple[torch.Tensor, int]) -> torch.Tensor:
    """A deferred entry's features [T, F, H]: a kept tensor, or row ``b`` of a target-only step's
    features kept as ``(features, b)``."""
    if isinstance(kept, tuple):
        features, b = kept
        return features[b]
    return kept
