"""Target-only decoding: one token per request from the target, as after prefill and for riders.

Mixin of :class:`~dspine.replica.model_runner.ModelRunner`: the target-only step and the one
sampling path (logit processing, filtering, the request's generator, Gumbel rows, logprobs)
that the prefill's first token and the riders of a speculative cycle share.
"""

from __future__ import annotations

import torch

from . import decoding, sampling
from .request import Request
from .types import RunnerOutput


class RunnerTargetStep:
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


    # ------------------------------------------------------------- sampling
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
