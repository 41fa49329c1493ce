"""Stop conditions and the release of output to streaming callers.

A request stops on EOS (unless ``ignore_eos``), on one of its stop token ids,
on a stop string, at ``max_new_tokens`` or at the context limit. Stop tokens
and stop strings are not part of the output. While stop strings are set, text
that could still grow into one is held back, so a streaming caller never sees
a partial stop string that is later cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sampling import SamplingParams
from .types import RequestStatus

# The tokenizer marks an incomplete UTF-8 sequence at the end with U+FFFD: hold it back.
_INCOMPLETE_CHAR = "\ufffd"


@dataclass
class Release:
    """What one call to :meth:`StopChecker.extend` lets out."""

    token_ids: list[int]  # newly released tokens
    text: str  # newly released text
    status: RequestStatus | None  # a finished status, or None while running


class StopChecker:
    """Owns a request's output tokens and decides when it stops and what is released."""

    def __init__(self, params: SamplingParams, prompt_len: int, max_context: int,
                 eos_token_ids: tuple[int, ...], decode=None):
        self.params = params
        self.prompt_len = prompt_len
        self.max_context = max_context
        self._stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_token_ids.update(eos_token_ids)
        self._decode = decode  # ids -> str, or None without a tokenizer
        if params.stop and decode is None:
            raise ValueError("stop: stop strings need a tokenizer")
        self.output_ids: list[int] = []
        self._released_tokens = 0
        self._released_text = ""

    @property
    def released_token_ids(self) -> list[int]:
        return self.output_ids[: self._released_tokens]

    @property
    def released_text(self) -> str:
        return self._released_text

    def extend(self, new_token_ids: list[int]) -> Release:
        """Append committed tokens, apply every stop rule, return what is released."""
        status = None
        for token_id in new_token_ids:
            if token_id in self._stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                break
            self.output_ids.append(token_id)
            if len(self.output_ids) >= self.params.max_new_tokens:
                status = RequestStatus.FINISHED_LENGTH
                break
            if self.prompt_len + len(self.output_ids) >= self.max_context:
                status = RequestStatus.FINISHED_LENGTH
                break
        if self._decode is None:
            return self._release_all_tokens(status)
        return self._release_text(status)

    def _release_all_tokens(self, status: RequestStatus | None) -> Release:
        released = self.output_ids[self._released_tokens:]
        self._released_tokens = len(self.output_ids)
        return Release(released, "", status)

    def _release_text(self, status: RequestStatus | None) -> Release:
        text = self._decode(self.output_ids)
        cut = self._find_stop_string(text)
        if cut is not None:
            status = RequestStatus.FINISHED_STOPPED
            text = text[:cut]
            keep = self._tokens_covering(text)
            del self.output_ids[keep:]
            safe_len = len(text)
        elif status is not None:
            safe_len = len(text)  # finished: nothing can grow any more
        else:
            safe_len = len(text) - self._holdback(text)
        safe_text = text[:safe_len]
        if safe_len == len(text):
            # nothing held back: every output token is covered (no incomplete character, or the
            # request finished), which _tokens_covering would find by decoding them all again
            safe_tokens = len(self.output_ids)
        else:
            safe_tokens = self._tokens_covering(safe_text)
        if status is not None:
            safe_tokens = len(self.output_ids)
        safe_tokens = max(safe_tokens, self._released_tokens)
        released_ids = self.output_ids[self._released_tokens:safe_tokens]
        released_text = safe_text[len(self._released_text):] if safe_text.startswith(self._released_text) else ""
        self._released_tokens = safe_tokens
        if len(safe_text) >= len(self._released_text):
            self._released_text = safe_text
        return Release(released_ids, released_text, status)

    def _find_stop_string(self, text: str) -> int | None:
        if not self.params.stop:
            return None
        # Only text that was not yet released can hold a new match.
        longest = max(len(s) for s in self.params.stop)
        start = max(0, len(self._released_text) - longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change or become a stop string."""
        hold = 0
        if text.endswith(_INCOMPLETE_CHAR):
            hold = 1
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def _tokens_covering(self, text: str) -> int:
        """The largest n such that the first n output tokens decode to a prefix of ``text``."""
        n = len(self.output_ids)
        while n > self._released_tokens:
            prefix = self._decode(self.output_ids[:n])
            if len(prefix) <= len(text) and text.startswith(prefix.rstrip(_INCOMPLETE_CHAR)) and not prefix.endswith(_INCOMPLETE_CHAR):
                return n
            n -= 1
        return n
