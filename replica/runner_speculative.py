"""One speculative cycle: draft -> tail -> verify -> commit, with target-only riders.

The step's target-only requests ride in the cycle's verify forward with one row each (their
pending token), so a step runs one target forward, not two. Mixin of
:class:`~dspine.replica.model_runner.ModelRunner`.
"""

from __future__ import annotations

import torch

from dspine import faults

from . import decoding, sampling, verify
from .request import Request
from .step_stats import StageInterval
from .types import RunnerOutput


class RunnerSpeculative:
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
        # two drafters: each drafter's requests contiguous, so their groups merge by concatenation
        request_ids, groups = self._grouped_by_drafter(request_ids)
        batch = [requests[r] for r in request_ids]
        riders = [requests[r] for r in rider_ids]
        params = [r.params for r in batch]
        generators = [self.generators[r] for r in request_ids]
        anchors = torch.tensor([r.pending_token_id for r in batch], dtype=torch.long, device=self.device)

        with self._timed(out, "draft", request_ids):
            self._fault("draft", request_ids)
            self._flush_context(request_ids)
            out.block_rows = self._block_rows(request_ids)
            draft_outs = self._draft_groups(groups, request_ids, anchors, out.block_rows)
        with self._timed(out, "tail", request_ids):
            self._fault("tail", request_ids)
            proposal = self._propose_groups(groups, draft_outs, request_ids, requests, anchors, params, generators)
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
            self._append_context(request_ids, [result.features[b, : accepted[b] + 1] for b in range(nb)])
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


    def _block_rows(self, request_ids: list[str]) -> int:
        """Rows of this cycle's draft block: the anchor and the most draft rows the plan verifies for
        any of its requests (a request the plan does not name, or no plan: the whole block). The
        rows past them would be drafted and never verified."""
        block = self.drafter.args.block_size
        if faults.active("runner.whole_block_drafted") or not self._draft_rows:
            return block
        return min(block, 1 + max(max(1, self._draft_rows.get(r, block - 1)) for r in request_ids))

    def propose(self, request_ids, requests, draft_out, anchors, params, generators, tail_tables=None):
        """The tail's proposal for the batch (``tail_tables``: the drafter's that drafted it; None: the
        greedy drafter's); tests replace this to force acceptance patterns."""
        from . import tail

        tables = self.tail_tables if tail_tables is None else tail_tables
        # a short block draws a whole block's coins too: a request's random stream never depends on the plan
        num_coins = self.drafter.args.block_size - 1
        if any(p.is_gumbel for p in params):  # seed-reproducible requests propose with the target's noise
            return decoding.propose(draft_out, tables, anchors, [requests[r] for r in request_ids],
                                    generators, with_confidence=self.config.verify_threshold > 0,
                                    num_coins=num_coins)
        temperature, top_k, top_p = sampling.batch_params(params, device=self.device)
        return tail.propose(draft_out, tables, anchors, temperature, top_k, top_p, generators,
                            with_confidence=self.config.verify_threshold > 0, num_coins=num_coins)

    def _verify_lengths(self, proposal, request_ids: list[str]) -> torch.Tensor:
        """[NB] int64: draft rows each request verifies: the step's plan, cut further by the
        confidence threshold (the whole block without either)."""
        from . import tail

        nb, num_slots = proposal.draft_ids.shape
        if proposal.confidence is None:
            lengths = torch.full((nb,), num_slots, dtype=torch.int64, device=proposal.draft_ids.device)
        else:
            lengths = tail.verify_lengths(proposal.confidence, self.config.verify_threshold)
        if self._draft_rows:
            planned = [self._draft_rows.get(r, num_slots) for r in request_ids]
            lengths = torch.minimum(lengths, torch.tensor(planned, dtype=torch.int64, device=lengths.device))
        return lengths

    def _verify(self, proposal, target_logits: torch.Tensor, batch: list[Request], generators,
                num_verified: torch.Tensor):
        # target_logits: [NB, T, V], T = 1 + max(num_verified); p is built by the same filtering as
        # target-only sampling. Draft rows past T - 1 were not verified by anyone.
        num_slots = proposal.draft_ids.shape[1]
        nb, bs, vocab = target_logits.shape
        verified = bs - 1
        draft_ids = proposal.draft_ids[:, :verified]
        ragged = num_verified if bool((num_verified != verified).any()) else None
        # logit bias and penalties; row t also counts the drafted y_1 .. y_t (logits_processors)
        target_logits = decoding.processed_logits(target_logits, batch, draft_ids)
        self._verified_logits = target_logits
        if all(r.params.is_greedy for r in batch):
            return verify.verify_greedy(draft_ids, target_logits, num_verified=ragged)
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
        # (The whole block's worth, however few rows this cycle drafted.)
        num_coins = max(num_slots, self.drafter.args.block_size - 1)
        coins = sampling.draw_uniforms(generators, num_coins + 1, device=self.device)  # [NB, BS]
        return verify.verify_sampled(
            draft_ids, proposal.q[:, :verified], target_probs, coins[:, :verified], coins[:, num_coins],
            draft_q_ids=proposal.cand_ids[:, :verified], greedy=greedy, num_verified=ragged,
        )
