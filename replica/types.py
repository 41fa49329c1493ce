"""Messages passed between the scheduler, the model runner and the engine.

Types only: no behaviour beyond small derived properties and ``make_empty``
constructors for tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .logprobs import TokenLogprobs
    from .step_stats import StageInterval, StepRecord


class RetrievalMode(str, enum.Enum):
    """How the tail finds each draft row's candidate tokens (the K best of the head's logits).

    It changes only what is proposed, never what is emitted (verification is exact)."""

    FP8 = "fp8"  # scan a row-scaled FP8 copy of the head for R, rescore those exactly (CUDA)
    BF16 = "bf16"  # scan a bf16 copy of the head (CPUs with native bf16 GEMMs)
    EXACT = "exact"  # the real head, in its own dtype


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status >= RequestStatus.FINISHED_STOPPED`` means finished."""

    WAITING = 0  # admitted, not yet prefilled
    RUNNING = 1  # prefilled, decoding
    FINISHED_STOPPED = 2  # EOS, stop token or stop string
    FINISHED_LENGTH = 3  # max_new_tokens or the context limit
    FINISHED_CANCELLED = 4  # cancelled by the caller
    FINISHED_ERROR = 5  # failed inside the engine

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class SchedulerOutput:
    """What the model runner does in one step."""

    prefill_ids: list[str]  # requests to prefill this step (then they hold one sampled token)
    speculative_ids: list[str]  # running requests that decode one speculative cycle
    target_only_ids: list[str]  # running requests that decode one target-only token
    finished_ids: list[str]  # requests finished since the last step: the runner frees their state
    # Adaptive speculation (speculation_policy): the most draft rows each speculative request
    # verifies this step; absent: as many as the block (and the confidence cut) allow.
    draft_rows: dict[str, int] = field(default_factory=dict)
    # Chunked prefill: the prompt range [start, end) each prefill request runs this step; absent:
    # the whole prompt. A request samples its first token in the step whose chunk ends its prompt.
    prefill_chunks: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The target-only requests run their own forward after the cycle's instead of riding in its
    # verify forward (which pads each of them to the longest drafting request's rows).
    riders_apart: bool = False

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls([], [], [], [])

    @property
    def is_empty(self) -> bool:
        return not (self.prefill_ids or self.speculative_ids or self.target_only_ids or self.finished_ids)


@dataclass
class StageTimes:
    """Wall time in seconds of each stage of one step."""

    prefill: float = 0.0
    draft: float = 0.0  # drafter forward (context fusion excluded: that is commit)
    tail: float = 0.0  # candidate retrieval, conditional tables and chain
    verify: float = 0.0  # target forward over [anchor, proposals] and acceptance
    commit: float = 0.0  # target state commit, draft KV append
    target_step: float = 0.0  # target-only decode forward and sampling
    # Per request: the part of its steps spent on other requests' stages (a newcomer's prefill,
    # the target-only rows) and on step bookkeeping; per step or engine: bookkeeping only.
    other: float = 0.0

    def add(self, other: "StageTimes") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class RunnerOutput:
    """What the model runner produced in one step."""

    new_token_ids: dict[str, list[int]]  # per request: tokens committed this step (before stop checks)
    accepted_len: dict[str, int]  # per speculative request: draft tokens accepted (0..block-1)
    failed: dict[str, str]  # per request that failed this step: the error text
    stage_times: StageTimes  # of the whole step
    draft_pool_used: int = 0  # slots in use after the step
    num_verified: dict[str, int] = field(default_factory=dict)  # per speculative request: draft tokens verified
    block_rows: int = 0  # rows of the step's draft block (anchor included; 0: nobody drafted)
    stage_intervals: list["StageInterval"] = field(default_factory=list)  # every stage run, in order
    # Speculative requests the draft pool could not extend (only under admission_reservation
    # "prompt"): their draft slots are freed and they decode target-only from now on.
    draft_demoted: list[str] = field(default_factory=list)
    # per request asking for logprobs: one entry per token of new_token_ids, in order
    new_logprobs: dict[str, list["TokenLogprobs"]] = field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> "RunnerOutput":
        return cls({}, {}, {}, StageTimes())


@dataclass
class SpecDecodingStats:
    """Acceptance statistics; per request and summed per engine."""

    num_draft_slots: int  # proposals per cycle (block size - 1)
    num_cycles: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_len_histogram: list[int] = field(default_factory=list)  # [num_draft_slots + 1]
    accepted_per_position: list[int] = field(default_factory=list)  # [num_draft_slots]

    def __post_init__(self) -> None:
        if not self.accepted_len_histogram:
            self.accepted_len_histogram = [0] * (self.num_draft_slots + 1)
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_draft_slots

    def observe_draft(self, num_verified: int, num_accepted: int) -> None:
        """One cycle that verified ``num_verified`` draft tokens and accepted ``num_accepted``."""
        self.num_cycles += 1
        self.num_draft_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        self.accepted_len_histogram[num_accepted] += 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def merge(self, other: "SpecDecodingStats") -> None:
        self.num_cycles += other.num_cycles
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, count in enumerate(other.accepted_len_histogram):
            self.accepted_len_histogram[i] += count
        for i, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += count

    @property
    def mean_accepted_len(self) -> float:
        """Mean accepted draft tokens per cycle (the committed tokens per cycle are one more)."""
        return self.num_accepted_tokens / self.num_cycles if self.num_cycles else 0.0

    @property
    def mean_committed_per_cycle(self) -> float:
        return self.mean_accepted_len + 1.0 if self.num_cycles else 0.0


@dataclass
class RequestStats:
    """Per-request timings and counters, returned with the result."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    speculative: bool = False
    drafter: str = ""  # "greedy" / "sampled": the drafter that proposed its tokens; "" when not speculative
    spec: SpecDecodingStats | None = None
    # The wall time of each stage this request took part in (its own intervals, see step_stats).
    stage_times: StageTimes = field(default_factory=StageTimes)
    arrival_time: float = 0.0  # time.perf_counter() when admitted
    scheduled_time: float | None = None  # start of the first step it took part in
    first_token_time: float | None = None
    finish_time: float | None = None
    peak_draft_pool_slots: int = 0  # slots this request held at its peak
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of each commit
    steps: list["StepRecord"] = field(default_factory=list)  # the steps it took part in, in order

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_second(self) -> float:
        """Output tokens after the first, over the time after the first token."""
        if self.first_token_time is None or self.finish_time is None or self.num_output_tokens < 2:
            return 0.0
        elapsed = self.finish_time - self.first_token_time
        return (self.num_output_tokens - 1) / elapsed if elapsed > 0 else 0.0


@dataclass
class GenerationResult:
    """The finished output of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (stop strings already cut)
    text: str | None  # decoded text when the engine has a tokenizer
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    stats: RequestStats
    error: str | None = None
    logprobs: list["TokenLogprobs"] | None = None  # one per token of token_ids when the request asked


@dataclass
class StreamChunk:
    """Tokens released to a streaming caller; the last chunk carries ``finish_reason``."""

    request_id: str
    token_ids: list[int]  # newly released tokens
    text: str  # newly released text ("" without a tokenizer)
    finish_reason: str | None = None
    stats: RequestStats | None = None  # on the last chunk
    error: str | None = None
    logprobs: list["TokenLogprobs"] | None = None  # one per token of token_ids when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
