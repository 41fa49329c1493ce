"""The request messages of the SDK's calls, built from Python arguments.

No range checks here: the server owns validation. Only what protobuf itself refuses (a negative
``uint64``, a string where a number goes) is caught, as :class:`InvalidArgument` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from dspine.protos.dspine.v1 import dspine_pb2 as pb

from ..client_errors import InvalidArgument


def _set(target, name: str, value, path: str) -> None:
    """Assign a proto field; a value protobuf refuses becomes InvalidArgument naming the field."""
    try:
        if isinstance(value, (list, tuple)):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{path}: {e}", field=path) from None


def _chat(messages, add_generation_prompt: bool | None) -> pb.ChatMessages:
    chat = pb.ChatMessages()
    for i, message in enumerate(messages):
        role, content = (message["role"], message["content"]) if isinstance(message, Mapping) else message
        item = chat.messages.add()
        _set(item, "role", role, f"messages[{i}].role")
        _set(item, "content", content, f"messages[{i}].content")
    if add_generation_prompt is not None:
        chat.add_generation_prompt = bool(add_generation_prompt)
    return chat


def build_generate_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                           messages: Iterable | None = None, add_generation_prompt: bool | None = None,
                           max_new_tokens: int | None = None, temperature: float | None = None,
                           top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                           stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                           min_p: float | None = None, repetition_penalty: float | None = None,
                           presence_penalty: float | None = None, frequency_penalty: float | None = None,
                           logit_bias: Mapping[int, float] | None = None, logprobs: int | None = None,
                           reproducible: bool = False,
                           speculative: bool | None = None, request_id: str | None = None) -> pb.GenerateRequest:
    """The ``GenerateRequest`` for these arguments (no range checks: the server owns validation)."""
    given = [name for name, value in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages))
             if value is not None]
    if len(given) != 1:
        raise InvalidArgument(f"prompt: give exactly one of prompt, token_ids or messages (got {given or 'none'})",
                              field="prompt")
    request = pb.GenerateRequest()
    if prompt is not None:
        _set(request, "text", prompt, "text")
    elif token_ids is not None:
        _set(request.token_ids, "ids", list(token_ids), "token_ids")
    else:
        request.messages.CopyFrom(_chat(messages, add_generation_prompt))
    sampling = request.sampling
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p), ("seed", seed), ("min_p", min_p),
                        ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("logprobs", logprobs)):
        if value is not None:
            _set(sampling, name, value, f"sampling.{name}")
    _set(sampling, "stop", list(stop), "sampling.stop")
    _set(sampling, "stop_token_ids", list(stop_token_ids), "sampling.stop_token_ids")
    sampling.ignore_eos = bool(ignore_eos)
    if logit_bias:
        try:
            sampling.logit_bias.update({int(k): float(v) for k, v in dict(logit_bias).items()})
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"sampling.logit_bias: {e}", field="sampling.logit_bias") from None
    sampling.reproducible = bool(reproducible)
    if speculative is not None:
        request.speculative = bool(speculative)
    if request_id:
        _set(request, "request_id", request_id, "request_id")
    return request


def build_tokenize_request(text: str | None, messages, add_special_tokens: bool | None) -> pb.TokenizeRequest:
    """The ``TokenizeRequest`` of exactly one of ``text`` or chat ``messages``."""
    if (text is None) == (messages is None):
        raise InvalidArgument("input: give exactly one of text or messages", field="input")
    request = pb.TokenizeRequest()
    if text is not None:
        _set(request, "text", text, "text")
    else:
        request.messages.CopyFrom(_chat(messages, None))
    if add_special_tokens is not None:
        request.add_special_tokens = bool(add_special_tokens)
    return request


def build_detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool) -> pb.DetokenizeRequest:
    """The ``DetokenizeRequest`` of ``token_ids``."""
    request = pb.DetokenizeRequest(skip_special_tokens=skip_special_tokens)
    _set(request, "token_ids", list(token_ids), "token_ids")
    return request
