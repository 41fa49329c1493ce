"""Validation of every request field before the engine sees it (pydantic at the edge).

What a request may ask (:class:`ValidationLimits`) and the request models that
check it, raising :class:`~dspine.replica.errors.InvalidRequestError`
(-> INVALID_ARGUMENT) whose message is ``field: reason``, where ``field`` is
the request path a client wrote (``sampling.temperature``, ``token_ids[3]``,
``messages[0].role``, ``request_id``). :func:`validate_generate` checks the
shape and range of every field: pure data, no tokenizer. Turning the checked
input into the engine's types (encoding, chat rendering) is
:func:`dspine.cluster.prompt.prepare_generate`'s job.

Decisions a client can rely on:
- exactly one prompt: ``text`` XOR ``token_ids`` XOR ``messages``, non-empty;
- ``max_new_tokens`` in [1, max_context]; generation still ends with
  ``length`` at the context limit when prompt + output would exceed it;
- ``temperature`` finite in [0, 100]; ``top_p`` in (0, 1]; ``top_k`` in
  [0, 2**31); ``seed`` in [0, 2**64);
- ``min_p`` in [0, 1]; ``repetition_penalty`` in (0, 100]; ``presence_penalty``
  and ``frequency_penalty`` in [-2, 2]; ``logit_bias`` at most 1024 entries, ids
  inside the vocabulary, biases finite in [-100, 100]; ``logprobs`` in [0, 20];
  ``reproducible`` needs a ``seed``;
- at most 16 stop strings of 1..256 characters; at most 64 stop token ids,
  each inside the vocabulary; stop strings need a tokenizer;
- ``request_id`` empty (the server picks one) or 1..128 of ``[A-Za-z0-9._:-]``;
- ``speculative = true`` without a drafter raises ``NoDrafterError``
  (FAILED_PRECONDITION), not INVALID_ARGUMENT: the request is fine, the server is not.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dspine.replica.description import EngineDescription
from dspine.replica.errors import InvalidRequestError, NoDrafterError
from dspine.replica.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS
from dspine.replica.request_rules import prompt_length_problem, seed_problem, token_id_problem, token_ids_problem

_MAX_REPETITION_PENALTY = 100.0  # beyond it every seen token is simply banned; a bound keeps it finite
_MAX_LOGIT_BIAS_ENTRIES = 1024

__all__ = [
    "ValidationLimits",
    "SamplingInput",
    "ChatMessageInput",
    "GenerateInput",
    "validate_generate",
    "validate_token_ids",
    "validate_text",
    "invalid_from_pydantic",
]

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")
_MAX_TOP_K = 2**31


class ValidationLimits(BaseModel):
    """What a request may ask of this server; built once per served engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(gt=0, description="valid token ids are [0, vocab_size)")
    max_context: int = Field(ge=2, description="prompt + output tokens (the engine's max_seq_len)")
    default_max_new_tokens: int = Field(256, ge=1, description="used when a request leaves max_new_tokens unset")
    has_tokenizer: bool = Field(False, description="text prompts, stop strings and tokenization need one")
    has_chat_template: bool = Field(False, description="chat messages need one")
    has_drafter: bool = Field(False, description="speculative=true needs one")
    max_temperature: float = Field(100.0, gt=0)
    max_prompt_chars: int = Field(1_000_000, ge=1, description="text / chat content characters, before tokenizing")
    max_chat_messages: int = Field(256, ge=1)
    max_stop_strings: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)
    max_stop_token_ids: int = Field(64, ge=0)
    max_request_id_chars: int = Field(128, ge=1)

    @model_validator(mode="after")
    def _default_fits_context(self) -> "ValidationLimits":
        if self.default_max_new_tokens > self.max_context:
            object.__setattr__(self, "default_max_new_tokens", self.max_context)
        return self

    @classmethod
    def from_description(cls, description: EngineDescription, **overrides) -> "ValidationLimits":
        """The limits of the engine ``description`` describes (``overrides`` replace fields)."""
        fields: dict[str, Any] = dict(
            vocab_size=description.vocab_size,
            max_context=description.max_context,
            has_tokenizer=description.has_tokenizer,
            has_chat_template=description.has_chat_template,
            has_drafter=description.has_drafter,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_engine(cls, engine, **overrides) -> "ValidationLimits":
        """The limits of ``engine`` (through its :class:`EngineDescription`)."""
        return cls.from_description(engine.describe(), **overrides)


def _limits(info: ValidationInfo) -> ValidationLimits:
    limits = (info.context or {}).get("limits")
    if not isinstance(limits, ValidationLimits):
        raise TypeError("validate with context={'limits': ValidationLimits(...)}")
    return limits


def _check_token_id(value: int, limits: ValidationLimits) -> None:
    if (problem := token_id_problem(value, limits.vocab_size)) is not None:
        raise ValueError(problem)


class SamplingInput(BaseModel):
    """``GenerateRequest.sampling``; ``None`` means "unset: use the default"."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: StrictFloat | None = None
    top_k: StrictInt | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    max_new_tokens: StrictInt | None = None
    stop: tuple[StrictStr, ...] = ()
    stop_token_ids: tuple[StrictInt, ...] = ()
    ignore_eos: StrictBool = False
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[StrictInt, StrictFloat] = Field(default_factory=dict)
    logprobs: StrictInt | None = None
    reproducible: StrictBool = False

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"must be in [0, 1] (0 disables it), got {v!r}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and 0.0 < v <= _MAX_REPETITION_PENALTY):
            raise ValueError(f"must be in (0, {_MAX_REPETITION_PENALTY:g}] (1 disables it), got {v!r}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _additive_penalty(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and -2.0 <= v <= 2.0):
            raise ValueError(f"must be in [-2, 2] (0 disables it), got {v!r}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float], info: ValidationInfo) -> dict[int, float]:
        limits = _limits(info)
        if len(v) > _MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {_MAX_LOGIT_BIAS_ENTRIES} entries, got {len(v)}")
        for token, bias in sorted(v.items()):
            try:
                _check_token_id(token, limits)
            except ValueError as e:
                raise ValueError(f"key {e}") from e
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise ValueError(f"bias of token {token} must be finite in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias!r}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {v}")
        return v

    @field_validator("reproducible")
    @classmethod
    def _reproducible(cls, v: bool, info: ValidationInfo) -> bool:
        # declared after seed, so info.data holds it (unless seed itself was invalid)
        if v and "seed" in info.data and info.data["seed"] is None:
            raise ValueError("needs a seed (the noise is derived from the seed and the position)")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None, info: ValidationInfo) -> float | None:
        limit = _limits(info).max_temperature
        if v is not None and not (math.isfinite(v) and 0.0 <= v <= limit):
            raise ValueError(f"must be finite and in [0, {limit:g}] (0 = greedy), got {v!r}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < _MAX_TOP_K:
            raise ValueError(f"must be in [0, 2**31) (0 disables it), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and 0.0 < v <= 1.0):
            raise ValueError(f"must be in (0, 1] (1 disables it), got {v!r}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and (problem := seed_problem(v)) is not None:
            raise ValueError(problem)
        return v

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        limit = _limits(info).max_context
        if v is not None and not 1 <= v <= limit:
            raise ValueError(f"must be in [1, {limit}] (the context of this server), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        limits = _limits(info)
        if len(v) > limits.max_stop_strings:
            raise ValueError(f"at most {limits.max_stop_strings} stop strings, got {len(v)}")
        for i, s in enumerate(v):
            if not 1 <= len(s) <= limits.max_stop_chars:
                raise ValueError(f"entry {i} must have 1..{limits.max_stop_chars} characters, got {len(s)}")
        if v and not limits.has_tokenizer:
            raise ValueError("stop strings need a tokenizer and this server has none; use stop_token_ids")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        limits = _limits(info)
        if len(v) > limits.max_stop_token_ids:
            raise ValueError(f"at most {limits.max_stop_token_ids} stop token ids, got {len(v)}")
        for i, token in enumerate(v):
            try:
                _check_token_id(token, limits)
            except ValueError as e:
                raise ValueError(f"entry {i}: {e}") from e
        return v


class ChatMessageInput(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    role: StrictStr
    content: StrictStr

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"must be one of {sorted(CHAT_ROLES)}, got {v[:32]!r}")
        return v


class GenerateInput(BaseModel):
    """A generate request as plain data; exactly one of ``text``, ``token_ids``, ``messages``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: StrictStr | None = None
    token_ids: tuple[StrictInt, ...] | None = None
    messages: tuple[ChatMessageInput, ...] | None = None
    add_generation_prompt: StrictBool = True
    sampling: SamplingInput = SamplingInput.model_construct()
    speculative: StrictBool | None = None
    request_id: StrictStr = ""

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            validate_text(v, _limits(info), field=None)
        return v

    @field_validator("token_ids")
    @classmethod
    def _token_ids(cls, v: tuple[int, ...] | None, info: ValidationInfo) -> tuple[int, ...] | None:
        limits = _limits(info)
        if v is not None:
            if not v:
                raise ValueError("must not be empty")
            if (too_long := prompt_length_problem(len(v), limits.max_context)) is not None:
                raise ValueError(too_long)
            if (bad := token_ids_problem(v, limits.vocab_size)) is not None:
                raise ValueError(f"element {bad[0]}: {bad[1]}")
        return v

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: tuple[ChatMessageInput, ...] | None, info: ValidationInfo):
        limits = _limits(info)
        if v is not None:
            if not v:
                raise ValueError("must hold at least one message")
            if len(v) > limits.max_chat_messages:
                raise ValueError(f"at most {limits.max_chat_messages} messages, got {len(v)}")
            chars = sum(len(m.content) for m in v)
            if chars > limits.max_prompt_chars:
                raise ValueError(f"content has {chars} characters in all; the limit is {limits.max_prompt_chars}")
            if not limits.has_tokenizer or not limits.has_chat_template:
                raise ValueError("this server's tokenizer has no chat template; send text or token_ids")
        return v

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, v: str, info: ValidationInfo) -> str:
        limit = _limits(info).max_request_id_chars
        if v and (len(v) > limit or not _REQUEST_ID.fullmatch(v)):
            raise ValueError(f"must be 1..{limit} characters of [A-Za-z0-9._:-] (or empty), got {v[:40]!r}")
        return v

    @model_validator(mode="after")
    def _one_prompt(self, info: ValidationInfo) -> "GenerateInput":
        given = [name for name in ("text", "token_ids", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            got = " and ".join(given) if given else "none"
            raise ValueError(f"prompt: exactly one of text, token_ids or messages is required, got {got}")
        if self.speculative and not _limits(info).has_drafter:
            # Not a bad field but a server without a drafter: FAILED_PRECONDITION.
            raise NoDrafterError("speculative: this server has no drafter; leave it unset or false")
        return self


def validate_text(text: str, limits: ValidationLimits, field: str | None = "text") -> None:
    """A text to encode: non-empty, bounded, and a tokenizer to encode it with."""
    try:
        if not text:
            raise ValueError("must not be empty")
        if len(text) > limits.max_prompt_chars:
            raise ValueError(f"has {len(text)} characters; the limit is {limits.max_prompt_chars}")
        if not limits.has_tokenizer:
            raise ValueError("this server has no tokenizer; send token_ids")
    except ValueError as e:
        if field is None:
            raise
        raise InvalidRequestError(field, str(e)) from e


def validate_token_ids(ids, limits: ValidationLimits, field: str = "token_ids", allow_empty: bool = False) -> list[int]:
    """Token ids of the target vocabulary (Tokenize / Detokenize / prompts)."""
    ids = list(ids)
    if not ids and not allow_empty:
        raise InvalidRequestError(field, "must not be empty")
    if (bad := token_ids_problem(ids, limits.vocab_size)) is not None:
        raise InvalidRequestError(f"{field}[{bad[0]}]", bad[1])
    return ids


def _path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part:
            path += f".{part}" if path else str(part)
    return path


def invalid_from_pydantic(error: ValidationError) -> InvalidRequestError:
    """The first pydantic error as ``InvalidRequestError(field, reason)``."""
    first = error.errors(include_url=False)[0]
    cause = (first.get("ctx") or {}).get("error")
    message = str(cause) if isinstance(cause, Exception) else first["msg"]
    field = _path(tuple(first["loc"]))
    if not field:  # a model-level check: its message is already "field: reason"
        field, _, message = message.partition(": ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    return InvalidRequestError(field or "request", message)


def validate_generate(data: dict[str, Any], limits: ValidationLimits) -> GenerateInput:
    """Check a request given as plain data (see :class:`GenerateInput`); raise ``InvalidRequestError``."""
    try:
        return GenerateInput.model_validate(data, context={"limits": limits})
    except ValidationError as e:
        cause = (e.errors(include_url=False)[0].get("ctx") or {}).get("error")
        if isinstance(cause, NoDrafterError):
            raise cause from None
        raise invalid_from_pydantic(e) from None
