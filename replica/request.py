"""One request's host-side record.

``Request`` owns its token lists and stop state; others read them through
properties. Only the scheduler changes ``status``; the model runner owns the
request's device state (target state, draft KV slots, generator).
"""

from __future__ import annotations

import time

from .drafters import GREEDY
from .sampling import SamplingParams
from .stopping import Release, StopChecker
from .types import RequestStats, RequestStatus, SpecDecodingStats


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 speculative: bool, stop_checker: StopChecker, num_draft_slots: int, drafter: str | None = None):
        self.request_id = request_id
        self._prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.speculative = speculative
        # "greedy" / "sampled" (replica/drafters.py; chosen at admission, for its whole life); "" when
        # it does not speculate
        self.drafter = (drafter or GREEDY) if speculative else ""
        self.status = RequestStatus.WAITING
        self.error: str | None = None
        self._stop = stop_checker
        # Tokens committed by the target but not yet fed back to it: the next
        # step's anchor (speculative) or input (target-only). Exactly one while running.
        self.pending_token_id: int | None = None
        # Per committed token (when params.logprobs is set): its TokenLogprobs, in commit order.
        self.committed_logprobs: list = []
        self.stats = RequestStats(
            num_prompt_tokens=len(prompt_token_ids),
            speculative=speculative,
            drafter=self.drafter,
            spec=SpecDecodingStats(num_draft_slots) if speculative else None,
            arrival_time=time.perf_counter(),
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """All output tokens kept so far (released or held back for stop strings)."""
        return list(self._stop.output_ids)

    @property
    def released_token_ids(self) -> list[int]:
        return self._stop.released_token_ids

    @property
    def released_text(self) -> str:
        return self._stop.released_text

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_committed(self, token_ids: list[int]) -> Release:
        """Record tokens the target committed; returns what may be released and a stop status."""
        if token_ids:
            now = time.perf_counter()
            if self.stats.first_token_time is None:
                self.stats.first_token_time = now
            self.stats.token_times.append((now, len(token_ids)))
        release = self._stop.extend(token_ids)
        self.stats.num_output_tokens = len(self._stop.output_ids)
        if token_ids:
            self.pending_token_id = token_ids[-1]
        return release
