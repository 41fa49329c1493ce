"""What the SDK returns: frozen result dataclasses, and their conversion from the wire messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspine.protos.dspine.v1 import dspine_pb2 as pb

_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class SpeculationStats:
    speculative: bool = False
    cycles: int = 0
    mean_accepted_len: float = 0.0  # accepted draft tokens per cycle
    accepted_len_histogram: tuple[int, ...] = ()
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafter: str = ""  # "greedy" / "sampled": the drafter that proposed (server with two); "" not speculative


@dataclass(frozen=True)
class StageTimings:
    """Seconds of the request's own stage intervals (the whole wall time of each stage it took part in)."""

    prefill: float = 0.0
    draft: float = 0.0
    tail: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    target_step: float = 0.0
    time_to_first_token: float = 0.0
    other: float = 0.0  # the rest of its steps: other requests' stages, bookkeeping
    queue: float = 0.0  # admitted -> its first step


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the top-n alternatives ``(token_id, logprob)``, descending."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    usage: Usage
    speculation: SpeculationStats
    timings: StageTimings
    logprobs: list[TokenLogprob] | None = None  # one per token when the request asked (sampling logprobs)

    @property
    def decode_tokens_per_second(self) -> float:
        """Output tokens after the first over the engine's time after the first token (as the
        engine's own ``RequestStats.decode_tokens_per_second``, from the server's timings)."""
        t = self.timings
        in_steps = t.prefill + t.draft + t.tail + t.verify + t.commit + t.target_step + t.other
        elapsed = t.queue + in_steps - t.time_to_first_token  # finish - first token
        tokens = len(self.token_ids)
        return (tokens - 1) / elapsed if tokens > 1 and elapsed > 0 else 0.0


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message; the last has ``finish_reason`` and the stats."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    speculation: SpeculationStats | None = None
    timings: StageTimings | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ModelInfo:
    target_name: str
    target_type: str
    vocab_size: int
    has_drafter: bool
    block_size: int
    max_concurrency: int
    max_context: int
    has_tokenizer: bool
    has_chat_template: bool
    eos_token_ids: tuple[int, ...]
    speculative_default: bool
    default_max_new_tokens: int
    drafters: tuple[str, ...] = ()  # (), ("greedy",) or ("greedy", "sampled")
    sampled_draft_min_temperature: float = 0.0  # from it a request drafts with "sampled" (0: one drafter)


def usage_of(m: pb.Usage) -> Usage:
    return Usage(m.prompt_tokens, m.completion_tokens)


def speculation_of(m: pb.SpeculationStats) -> SpeculationStats:
    return SpeculationStats(m.speculative, m.cycles, m.mean_accepted_len, tuple(m.accepted_len_histogram),
                            m.draft_tokens, m.accepted_tokens, m.drafter)


def timings_of(m: pb.StageTimings) -> StageTimings:
    return StageTimings(m.prefill, m.draft, m.tail, m.verify, m.commit, m.target_step, m.time_to_first_token,
                        m.other, m.queue)


def logprobs_of(entries) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in entries]


def result_of(m: pb.GenerateResponse, asked_logprobs: bool = False) -> GenerateResult:
    """The :class:`GenerateResult` of a ``GenerateResponse``; ``logprobs`` is a list (maybe empty)
    when the request asked for them, else None unless the server sent some."""
    return GenerateResult(m.request_id, m.text, list(m.token_ids), _FINISH_REASONS.get(m.finish_reason, "stop"),
                          usage_of(m.usage), speculation_of(m.speculation), timings_of(m.timings),
                          logprobs_of(m.logprobs) if asked_logprobs or len(m.logprobs) else None)


def chunk_of(m: pb.GenerateStreamResponse) -> GenerateChunk:
    """The :class:`GenerateChunk` of a stream message; only the last (with a finish reason) has stats."""
    reason = _FINISH_REASONS.get(m.finish_reason)
    if reason is None:
        return GenerateChunk(m.request_id, m.text, list(m.token_ids), logprobs=logprobs_of(m.logprobs))
    return GenerateChunk(m.request_id, m.text, list(m.token_ids), reason, usage_of(m.usage),
                         speculation_of(m.speculation), timings_of(m.timings), logprobs_of(m.logprobs))


def model_info_of(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(m.target_name, m.target_type, m.vocab_size, m.has_drafter, m.block_size, m.max_concurrency,
                     m.max_context, m.has_tokenizer, m.has_chat_template, tuple(m.eos_token_ids),
                     m.speculative_default, m.default_max_new_tokens, tuple(m.drafters),
                     m.sampled_draft_min_temperature)
