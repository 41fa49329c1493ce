"""Request validation as plain data (no server): every rejection is ``field: reason``."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from dspine.cluster.errors import error_field, status_for
from dspine.cluster.prompt import prepare_generate
from dspine.cluster.validation import (
    ValidationLimits,
    validate_generate,
    validate_token_ids,
)
from dspine.replica.errors import (
    EngineFullError,
    EngineStoppedError,
    InvalidRequestError,
    NoDrafterError,
    RequestCancelledError,
    RequestFailedError,
)

LIMITS = ValidationLimits(vocab_size=512, max_context=64, has_tokenizer=True, has_chat_template=True,
                          has_drafter=True, default_max_new_tokens=256)


def check(data, limits=LIMITS):
    return validate_generate(data, limits)


def rejected(data, limits=LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        check(data, limits)
    assert str(info.value).startswith(f"{info.value.field}: ")
    return info.value


@pytest.mark.parametrize("data, field", [
    ({}, "prompt"),
    ({"text": "a", "token_ids": [1]}, "prompt"),
    ({"text": ""}, "text"),
    ({"text": "x" * 1_000_001}, "text"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, 512]}, "token_ids"),
    ({"token_ids": [True]}, "token_ids[0]"),
    ({"token_ids": [1.5]}, "token_ids[0]"),
    ({"token_ids": [1] * 64}, "token_ids"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"token_ids": [1], "sampling": {"temperature": math.nan}}, "sampling.temperature"),
    ({"token_ids": [1], "sampling": {"temperature": -math.inf}}, "sampling.temperature"),
    ({"token_ids": [1], "sampling": {"temperature": "0.5"}}, "sampling.temperature"),
    ({"token_ids": [1], "sampling": {"top_p": 0.0}}, "sampling.top_p"),
    ({"token_ids": [1], "sampling": {"top_k": -1}}, "sampling.top_k"),
    ({"token_ids": [1], "sampling": {"top_k": 2**40}}, "sampling.top_k"),
    ({"token_ids": [1], "sampling": {"seed": -1}}, "sampling.seed"),
    ({"token_ids": [1], "sampling": {"seed": 2**64}}, "sampling.seed"),
    ({"token_ids": [1], "sampling": {"max_new_tokens": 65}}, "sampling.max_new_tokens"),
    ({"token_ids": [1], "sampling": {"max_new_tokens": True}}, "sampling.max_new_tokens"),
    ({"token_ids": [1], "sampling": {"stop": ["x"] * 17}}, "sampling.stop"),
    ({"token_ids": [1], "sampling": {"stop_token_ids": [512]}}, "sampling.stop_token_ids"),
    ({"token_ids": [1], "sampling": {"bogus": 1}}, "sampling.bogus"),
    ({"token_ids": [1], "sampling": {"min_p": math.nan}}, "sampling.min_p"),
    ({"token_ids": [1], "sampling": {"min_p": -0.1}}, "sampling.min_p"),
    ({"token_ids": [1], "sampling": {"repetition_penalty": 0.0}}, "sampling.repetition_penalty"),
    ({"token_ids": [1], "sampling": {"repetition_penalty": math.inf}}, "sampling.repetition_penalty"),
    ({"token_ids": [1], "sampling": {"presence_penalty": -2.5}}, "sampling.presence_penalty"),
    ({"token_ids": [1], "sampling": {"frequency_penalty": math.nan}}, "sampling.frequency_penalty"),
    ({"token_ids": [1], "sampling": {"logit_bias": {512: 1.0}}}, "sampling.logit_bias"),
    ({"token_ids": [1], "sampling": {"logit_bias": {3: math.inf}}}, "sampling.logit_bias"),
    ({"token_ids": [1], "sampling": {"logit_bias": {i: 1.0 for i in range(1025)}}}, "sampling.logit_bias"),
    ({"token_ids": [1], "sampling": {"logprobs": 21}}, "sampling.logprobs"),
    ({"token_ids": [1], "sampling": {"logprobs": 1.5}}, "sampling.logprobs"),
    ({"token_ids": [1], "sampling": {"reproducible": True}}, "sampling.reproducible"),
    ({"token_ids": [1], "request_id": "a/b"}, "request_id"),
    ({"token_ids": [1], "request_id": "é"}, "request_id"),
    ({"token_ids": [1], "speculative": "yes"}, "speculative"),
])
def test_rejections_name_the_field(data, field):
    assert rejected(data).field == field


def test_request_options_reach_the_engine_params():
    request = check({"token_ids": [1], "sampling": {
        "min_p": 0.05, "repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 2.0,
        "logit_bias": {7: -100.0, 3: 2.5}, "logprobs": 20, "reproducible": True, "seed": 9, "temperature": 0.7}})
    params = prepare_generate(request, LIMITS).params
    assert (params.min_p, params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        0.05, 1.2, -0.5, 2.0)
    assert params.logit_bias == ((3, 2.5), (7, -100.0)) and params.logprobs == 20 and params.is_gumbel
    defaults = prepare_generate(check({"token_ids": [1]}), LIMITS).params
    assert (defaults.min_p, defaults.repetition_penalty, defaults.logit_bias, defaults.logprobs,
            defaults.reproducible) == (0.0, 1.0, (), None, False)


def test_capabilities():
    bare = ValidationLimits(vocab_size=512, max_context=64)
    assert rejected({"text": "hi"}, bare).field == "text"
    assert rejected({"messages": [{"role": "user", "content": "x"}]}, bare).field == "messages"
    assert rejected({"token_ids": [1], "sampling": {"stop": ["x"]}}, bare).field == "sampling.stop"
    with pytest.raises(NoDrafterError, match="^speculative: "):
        check({"token_ids": [1], "speculative": True}, bare)
    assert check({"token_ids": [1], "speculative": False}, bare).speculative is False


def test_valid_request_and_defaults():
    checked = check({"token_ids": (1, 2), "sampling": {"temperature": 0.7, "top_k": 5, "seed": 2**64 - 1,
                                                      "stop": ["\n\n"], "stop_token_ids": [0]},
                     "request_id": "req-1.a:b_c"})
    prepared = prepare_generate(checked, LIMITS)
    assert prepared.prompt_token_ids == [1, 2]
    assert prepared.params.temperature == 0.7 and prepared.params.top_k == 5 and prepared.params.top_p == 1.0
    assert prepared.params.max_new_tokens == 64  # the default is clamped to the context
    assert prepared.request_id == "req-1.a:b_c"
    assert len(prepare_generate(check({"token_ids": [3]}), LIMITS).request_id) == 32


def test_text_prompt_length_checked_after_encoding():
    class Chars:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) % 512 for c in text]

    assert prepare_generate(check({"text": "abc"}), LIMITS, Chars()).prompt_token_ids == [97, 98, 99]
    with pytest.raises(InvalidRequestError, match="^text: prompt has 64 tokens"):
        prepare_generate(check({"text": "a" * 64}), LIMITS, Chars())


def test_token_ids_helper():
    assert validate_token_ids([], LIMITS, allow_empty=True) == []
    with pytest.raises(InvalidRequestError, match=r"^token_ids\[1\]: "):
        validate_token_ids([0, -1], LIMITS)


def test_limits_validate_themselves():
    with pytest.raises(ValidationError):
        ValidationLimits(vocab_size=0, max_context=64)
    assert ValidationLimits(vocab_size=8, max_context=16).default_max_new_tokens == 16


@pytest.mark.parametrize("exc, code", [
    (InvalidRequestError("sampling.top_p", "bad"), "INVALID_ARGUMENT"),
    (ValueError("request_id: 'x' is already in flight"), "INVALID_ARGUMENT"),
    (EngineFullError(8, 8), "RESOURCE_EXHAUSTED"),
    (NoDrafterError("speculative: none"), "FAILED_PRECONDITION"),
    (RequestCancelledError("gone"), "CANCELLED"),
    (TimeoutError("late"), "DEADLINE_EXCEEDED"),
    (EngineStoppedError("stopping"), "UNAVAILABLE"),
    (RequestFailedError("boom"), "INTERNAL"),
    (KeyError("bug"), "INTERNAL"),
])
def test_status_mapping(exc, code):
    status, details = status_for(exc)
    assert status.name == code
    if code == "INTERNAL" and isinstance(exc, KeyError):
        assert "bug" not in details  # internals stay in the server log


def test_error_field():
    assert error_field(InvalidRequestError("messages[0].role", "x")) == "messages[0].role"
    assert error_field(ValueError("request_id: dup")) == "request_id"
    assert error_field(ValueError("something went wrong: x")) is None
