"""Conversions between the dspine.v1 protos and the engine's plain data, in both directions.

Requests: a ``GenerateRequest`` becomes the plain dict the pydantic request
models check (an unset optional field stays unset, so defaults apply).
Results: the engine's ``StreamChunk`` / ``RequestStats`` become response
fields (finish reason, usage, speculation, timings, logprobs). No gRPC, no
engine calls: pure functions, tested through the service.
"""

from __future__ import annotations

from dspine.protos.dspine.v1 import dspine_pb2 as pb
from dspine.replica.errors import RequestCancelledError, RequestFailedError
from dspine.replica.types import RequestStats, StreamChunk

__all__ = ["chat_data", "generate_input_data", "logprobs_pb", "fill_final", "raise_if_abnormal"]

_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty", "logprobs")


def chat_data(chat: pb.ChatMessages) -> dict:
    """``ChatMessages`` as the plain data the request models check."""
    data = {"messages": tuple({"role": m.role, "content": m.content} for m in chat.messages)}
    if chat.HasField("add_generation_prompt"):
        data["add_generation_prompt"] = chat.add_generation_prompt
    return data


def generate_input_data(request: pb.GenerateRequest) -> dict:
    """A ``GenerateRequest`` as the plain data :func:`validate_generate` checks (unset stays unset)."""
    data: dict = {}
    kind = request.WhichOneof("prompt")
    if kind == "text":
        data["text"] = request.text
    elif kind == "token_ids":
        data["token_ids"] = tuple(request.token_ids.ids)
    elif kind == "messages":
        data.update(chat_data(request.messages))
    if request.HasField("sampling"):
        s = request.sampling
        sampling = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
        sampling.update(stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                        logit_bias=dict(s.logit_bias), reproducible=s.reproducible)
        data["sampling"] = sampling
    if request.HasField("speculative"):
        data["speculative"] = request.speculative
    data["request_id"] = request.request_id
    return data


def logprobs_pb(entries) -> list[pb.TokenLogprob]:
    """The engine's per-token logprob entries as protos."""
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top]) for e in entries or ()]


def fill_final(msg, stats: RequestStats | None, prompt_tokens: int, completion_tokens: int,
                finish_reason: str) -> None:
    """Fill the final message's finish reason, usage, speculation stats and stage timings."""
    msg.finish_reason = _FINISH_REASONS[finish_reason]
    msg.usage.prompt_tokens = prompt_tokens
    msg.usage.completion_tokens = completion_tokens
    if stats is None:
        return
    spec = msg.speculation
    spec.speculative = stats.speculative
    spec.drafter = stats.drafter
    if stats.spec is not None:
        spec.cycles = stats.spec.num_cycles
        spec.mean_accepted_len = stats.spec.mean_accepted_len
        spec.accepted_len_histogram.extend(stats.spec.accepted_len_histogram)
        spec.draft_tokens = stats.spec.num_draft_tokens
        spec.accepted_tokens = stats.spec.num_accepted_tokens
    t = stats.stage_times
    timings = msg.timings
    timings.prefill, timings.draft, timings.tail = t.prefill, t.draft, t.tail
    timings.verify, timings.commit, timings.target_step = t.verify, t.commit, t.target_step
    timings.other = t.other
    timings.time_to_first_token = stats.time_to_first_token or 0.0
    if stats.scheduled_time is not None:
        timings.queue = stats.scheduled_time - stats.arrival_time


def raise_if_abnormal(chunk: StreamChunk) -> None:
    """A final chunk that is not a normal finish (stop / length) as the typed error it stands for."""
    if chunk.finish_reason == "cancelled":
        raise RequestCancelledError(f"request {chunk.request_id} was cancelled")
    if chunk.finish_reason not in _FINISH_REASONS:
        raise RequestFailedError(chunk.error or f"request {chunk.request_id} ended with {chunk.finish_reason!r}")
