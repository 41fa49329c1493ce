"""A checked generate request in the engine's types: the prompt encoded, the sampling built.

:func:`prepare_generate` takes what :func:`~dspine.cluster.validation.validate_generate`
returned and encodes its text (or renders its chat messages through the
tokenizer's template, :mod:`dspine.cluster.chat`, and encodes that), checks the
encoded prompt against the context and the vocabulary, and builds a
``SamplingParams``. Errors are :class:`~dspine.replica.errors.InvalidRequestError`
naming the request field. Encoding a long text takes a while: the service runs
this in its admission executor, never on the event loop.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from dspine.replica.errors import InvalidRequestError
from dspine.replica.request_rules import prompt_length_problem, token_ids_problem
from dspine.replica.sampling import SamplingParams

from .validation import GenerateInput, ValidationLimits

__all__ = ["PreparedRequest", "encode_chat", "prepare_generate"]


@dataclass(frozen=True)
class PreparedRequest:
    """A checked request in the engine's types."""

    prompt_token_ids: list[int]
    params: SamplingParams
    speculative: bool | None
    request_id: str


def encode_chat(messages, add_generation_prompt: bool, tokenizer, template) -> list[int]:
    """Render ``messages`` with ``template`` (a :class:`~dspine.cluster.chat.ChatTemplate`) and encode."""
    text = template.render([{"role": m.role, "content": m.content} for m in messages], add_generation_prompt)
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword
        return tokenizer.encode(text)


def prepare_generate(request: GenerateInput, limits: ValidationLimits, tokenizer=None,
                     chat_template=None) -> PreparedRequest:
    """Encode the prompt, check its length against the context, build ``SamplingParams``."""
    if request.text is not None:
        field, ids = "text", list(tokenizer.encode(request.text))
    elif request.messages is not None:
        field = "messages"
        try:
            ids = encode_chat(request.messages, request.add_generation_prompt, tokenizer, chat_template)
        except ValueError as e:
            raise InvalidRequestError("messages", str(e).removeprefix("messages: ")) from e
    else:
        field, ids = "token_ids", list(request.token_ids)
    if not ids:
        raise InvalidRequestError(field, "encodes to no tokens")
    if (too_long := prompt_length_problem(len(ids), limits.max_context)) is not None:
        raise InvalidRequestError(field, too_long)
    if (bad := token_ids_problem(ids, limits.vocab_size)) is not None:  # a tokenizer larger than the model's vocabulary
        raise InvalidRequestError(field, f"encodes to element {bad[0]}: {bad[1]}")

    s = request.sampling
    fields = {
        "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed,
        "max_new_tokens": s.max_new_tokens if s.max_new_tokens is not None else limits.default_max_new_tokens,
        "stop": s.stop, "stop_token_ids": s.stop_token_ids, "ignore_eos": s.ignore_eos,
        "min_p": s.min_p, "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "logit_bias": dict(s.logit_bias), "logprobs": s.logprobs,
        "reproducible": s.reproducible,
    }
    try:
        params = SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as e:  # SamplingParams names the field first
        name, _, reason = str(e).partition(": ")
        raise InvalidRequestError(f"sampling.{name}", reason) from e
    return PreparedRequest(ids, params, request.speculative, request.request_id or uuid.uuid4().hex)
