"""Which drafter serves which request in the model runner, and a batch split by drafter.

With one drafter loaded every call below is the single call of before (no lookup, no copy).
With two (replica/drafters.py) a stage groups its requests by drafter, runs each group with its
own drafter (and tail tables), and merges the groups' results: the speculative cycle reorders
its batch so that each group is contiguous (greedy first, each group in batch order), so the
merge is a concatenation and every later stage (verify, commit) runs on the reordered batch,
whose outputs are keyed by request id. Each request's random streams are its own generator's,
so the reordering changes no request's draws. Mixin of
:class:`~dspine.replica.model_runner.ModelRunner` (reads ``drafters``, ``drafter``,
``tail_tables``, ``draft_pool`` and ``_request_drafter``).
"""

from __future__ import annotations

import torch

from dspine import faults

from .drafters import GREEDY, SAMPLED, LoadedDrafter

# One group of a batch: its drafter and its rows (contiguous) in the batch.
DrafterGroup = tuple[LoadedDrafter, slice]


class RunnerDrafters:
    def _drafter_of(self, request_id: str) -> LoadedDrafter:
        """The drafter chosen for this request at admission (the greedy one when only it is loaded)."""
        if len(self.drafters) == 1:
            return self.drafters[GREEDY]
        return self.drafters[self._request_drafter.get(request_id, GREEDY)]

    def _grouped_by_drafter(self, request_ids: list[str]) -> tuple[list[str], list[DrafterGroup]]:
        """``(request_ids in group order, groups)``: unchanged with one group."""
        whole = slice(0, len(request_ids))
        if len(self.drafters) == 1:
            return request_ids, [(self.drafters[GREEDY], whole)]
        names = [self._request_drafter.get(r, GREEDY) for r in request_ids]
        num_greedy = names.count(GREEDY)
        if num_greedy in (0, len(names)):
            return request_ids, [(self.drafters[names[0]], whole)]
        ordered = ([r for r, n in zip(request_ids, names) if n == GREEDY]
                   + [r for r, n in zip(request_ids, names) if n != GREEDY])
        greedy, sampled = self.drafters[GREEDY], self.drafters[SAMPLED]
        if faults.active("runner.drafter_groups_swapped"):
            greedy, sampled = sampled, greedy
        return ordered, [(greedy, slice(0, num_greedy)), (sampled, slice(num_greedy, len(names)))]

    def _draft_groups(self, groups: list[DrafterGroup], request_ids: list[str], anchors: torch.Tensor,
                      num_rows: int | None = None) -> list:
        """One draft forward per group (``anchors [NB]`` in group order) of ``num_rows`` block rows
        each (None: the whole block): the groups' DraftOuts."""
        # anchors: [NB] int64
        if len(groups) == 1:
            return [groups[0][0].model.draft(self.draft_pool, request_ids, anchors, num_rows=num_rows)]
        return [drafter.model.draft(self.draft_pool, request_ids[rows], anchors[rows], num_rows=num_rows)
                for drafter, rows in groups]

    def _propose_groups(self, groups: list[DrafterGroup], draft_outs: list, request_ids, requests, anchors,
                        params, generators):
        """Each group's tail proposal with its drafter's tables, concatenated in group (= batch) order."""
        def tables(drafter: LoadedDrafter) -> dict:
            # the greedy drafter's call is the call of a one-drafter engine (tests replace propose)
            return {} if drafter.tail_tables is self.tail_tables else {"tail_tables": drafter.tail_tables}

        if len(groups) == 1:
            return self.propose(request_ids, requests, draft_outs[0], anchors, params, generators,
                                **tables(groups[0][0]))
        proposals = [self.propose(request_ids[rows], requests, draft_out, anchors[rows], params[rows],
                                  generators[rows], **tables(drafter))
                     for (drafter, rows), draft_out in zip(groups, draft_outs)]
        return merge_proposals(proposals)

    def _append_context(self, request_ids: list[str], features: list[torch.Tensor]) -> None:
        """Append ``features[b] [T_b, F, H]`` to each request's draft context, with its own drafter."""
        if len(self.drafters) == 1:
            self.drafter.append_context(self.draft_pool, request_ids, features)
            return
        by_drafter: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
        for request_id, f in zip(request_ids, features):
            ids, feats = by_drafter.setdefault(self._drafter_of(request_id).name, ([], []))
            ids.append(request_id)
            feats.append(f)
        for name, (ids, feats) in by_drafter.items():
            self.drafters[name].model.append_context(self.draft_pool, ids, feats)


def merge_proposals(proposals: list):
    """The groups' :class:`~dspine.replica.tail.Proposal` s stacked along the batch (the groups are
    contiguous in the batch, in this order). The drafters may propose over different numbers of
    candidates (K): a narrower group's q and candidates are padded to the widest K with q = 0 on
    copies of the row's first candidate, which adds nothing wherever q is read (verification sums
    q over matching candidates) and is never chosen (``choice`` indexes the group's own K)."""
    from .tail import Proposal

    width = max(p.q.shape[-1] for p in proposals)
    confidence = None
    if proposals[0].confidence is not None:
        confidence = torch.cat([p.confidence for p in proposals])
    q_order = proposals[::-1] if faults.active("runner.proposals_merged_out_of_order") else proposals
    return Proposal(
        draft_ids=torch.cat([p.draft_ids for p in proposals]),  # [NB, BS-1]
        q=torch.cat([_padded(p.q, width, 0.0) for p in q_order]),  # [NB, BS-1, K_max]
        cand_ids=torch.cat([_padded(p.cand_ids, width, None) for p in q_order]),  # [NB, BS-1, K_max]
        choice=torch.cat([p.choice for p in proposals]),  # [NB, BS-1]
        confidence=confidence,  # [NB, BS-1] or None
    )


def _padded(values: torch.Tensor, width: int, fill: float | None) -> torch.Tensor:
    """``values [NB, BS-1, K]`` widened to ``width`` on the last dim: with ``fill``, or (None) with
    copies of each row's first entry."""
    # values: [NB, BS-1, K]
    missing = width - values.shape[-1]
    if missing == 0:
        return values
    if fill is None:
        pad = values[..., :1].expand(*values.shape[:-1], missing)
    else:
        pad = values.new_full((*values.shape[:-1], missing), fill)
    return torch.cat([values, pad], dim=-1)
