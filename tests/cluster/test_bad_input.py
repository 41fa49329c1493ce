"""Bad input over a real socket: the right status, details naming the field, and the server unharmed."""

from __future__ import annotations

import grpc
import pytest

from dspine.cluster.client import DSpineClient, RetryPolicy
from dspine.cluster.server import ServerConfig
from dspine.protos.dspine.v1 import dspine_pb2 as pb

from .conftest import ServerThread, idle, make_engine, wait_until

INVALID = grpc.StatusCode.INVALID_ARGUMENT
MAX_CONTEXT = 96
MAX_RECEIVE = 64 * 1024


@pytest.fixture(scope="module")
def full_server(tokenizer):
    """Drafter, tokenizer with a chat template, a 64 KiB receive limit."""
    server = ServerThread(make_engine(tokenizer, max_seq_len=MAX_CONTEXT),
                          ServerConfig(host="127.0.0.1", port=0, max_receive_message_bytes=MAX_RECEIVE))
    yield server
    server.close()


@pytest.fixture(scope="module")
def bare_server():
    """No drafter, no tokenizer."""
    server = ServerThread(make_engine(None, with_drafter=False, max_seq_len=MAX_CONTEXT),
                          ServerConfig(host="127.0.0.1", port=0))
    yield server
    server.close()


def _request(**fields) -> pb.GenerateRequest:
    sampling = fields.pop("sampling", {})
    request = pb.GenerateRequest(**fields)
    for name, value in sampling.items():
        if isinstance(value, list):
            getattr(request.sampling, name).extend(value)
        elif isinstance(value, dict):
            getattr(request.sampling, name).update(value)
        else:
            setattr(request.sampling, name, value)
    return request


def ids(*values):
    return pb.TokenIds(ids=list(values))


def chat(*pairs):
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in pairs])


OK = ids(1, 2, 3)
NAN, INF = float("nan"), float("inf")

# (id, request, expected field prefix); all INVALID_ARGUMENT on the full server.
CASES = [
    ("no-prompt", _request(), "prompt"),
    ("empty-text", _request(text=""), "text"),
    ("empty-token-ids", _request(token_ids=ids()), "token_ids"),
    ("out-of-vocab-id", _request(token_ids=ids(1, 512)), "token_ids"),
    ("negative-id", _request(token_ids=ids(-1, 2)), "token_ids"),
    ("huge-id", _request(token_ids=ids(2**62)), "token_ids"),
    ("prompt-too-long-ids", _request(token_ids=ids(*[7] * MAX_CONTEXT)), "token_ids"),
    ("prompt-too-long-text", _request(text="x = 1\n" * 200), "text"),
    ("max-new-tokens-zero", _request(token_ids=OK, sampling={"max_new_tokens": 0}), "sampling.max_new_tokens"),
    ("max-new-tokens-negative", _request(token_ids=OK, sampling={"max_new_tokens": -5}), "sampling.max_new_tokens"),
    ("max-new-tokens-huge", _request(token_ids=OK, sampling={"max_new_tokens": 2**62}), "sampling.max_new_tokens"),
    ("temperature-nan", _request(token_ids=OK, sampling={"temperature": NAN}), "sampling.temperature"),
    ("temperature-inf", _request(token_ids=OK, sampling={"temperature": INF}), "sampling.temperature"),
    ("temperature-negative", _request(token_ids=OK, sampling={"temperature": -0.5}), "sampling.temperature"),
    ("temperature-huge", _request(token_ids=OK, sampling={"temperature": 1e300}), "sampling.temperature"),
    ("top-p-zero", _request(token_ids=OK, sampling={"top_p": 0.0}), "sampling.top_p"),
    ("top-p-above-one", _request(token_ids=OK, sampling={"top_p": 1.5}), "sampling.top_p"),
    ("top-p-nan", _request(token_ids=OK, sampling={"top_p": NAN}), "sampling.top_p"),
    ("top-k-negative", _request(token_ids=OK, sampling={"top_k": -1}), "sampling.top_k"),
    ("too-many-stop-strings", _request(token_ids=OK, sampling={"stop": [f"s{i}" for i in range(17)]}), "sampling.stop"),
    ("over-long-stop-string", _request(token_ids=OK, sampling={"stop": ["y" * 257]}), "sampling.stop"),
    ("empty-stop-string", _request(token_ids=OK, sampling={"stop": [""]}), "sampling.stop"),
    ("stop-token-out-of-vocab", _request(token_ids=OK, sampling={"stop_token_ids": [3, 600]}),
     "sampling.stop_token_ids"),
    ("stop-token-negative", _request(token_ids=OK, sampling={"stop_token_ids": [-2]}), "sampling.stop_token_ids"),
    ("min-p-nan", _request(token_ids=OK, sampling={"min_p": NAN}), "sampling.min_p"),
    ("min-p-above-one", _request(token_ids=OK, sampling={"min_p": 1.5}), "sampling.min_p"),
    ("repetition-penalty-zero", _request(token_ids=OK, sampling={"repetition_penalty": 0.0}),
     "sampling.repetition_penalty"),
    ("repetition-penalty-nan", _request(token_ids=OK, sampling={"repetition_penalty": NAN}),
     "sampling.repetition_penalty"),
    ("presence-penalty-above-two", _request(token_ids=OK, sampling={"presence_penalty": 2.5}),
     "sampling.presence_penalty"),
    ("frequency-penalty-nan", _request(token_ids=OK, sampling={"frequency_penalty": NAN}),
     "sampling.frequency_penalty"),
    ("frequency-penalty-below-minus-two", _request(token_ids=OK, sampling={"frequency_penalty": -3.0}),
     "sampling.frequency_penalty"),
    ("logit-bias-out-of-vocab", _request(token_ids=OK, sampling={"logit_bias": {512: 1.0}}), "sampling.logit_bias"),
    ("logit-bias-negative-id", _request(token_ids=OK, sampling={"logit_bias": {-1: 1.0}}), "sampling.logit_bias"),
    ("logit-bias-nan", _request(token_ids=OK, sampling={"logit_bias": {5: NAN}}), "sampling.logit_bias"),
    ("logit-bias-huge", _request(token_ids=OK, sampling={"logit_bias": {5: 1e9}}), "sampling.logit_bias"),
    ("logprobs-above-twenty", _request(token_ids=OK, sampling={"logprobs": 21}), "sampling.logprobs"),
    ("logprobs-negative", _request(token_ids=OK, sampling={"logprobs": -1}), "sampling.logprobs"),
    ("reproducible-without-seed", _request(token_ids=OK, sampling={"reproducible": True, "temperature": 1.0}),
     "sampling.reproducible"),
    ("request-id-charset", _request(token_ids=OK, request_id="bad id!"), "request_id"),
    ("request-id-too-long", _request(token_ids=OK, request_id="r" * 129), "request_id"),
    ("chat-empty", _request(messages=chat()), "messages"),
    ("chat-bad-role", _request(messages=chat(("robot", "hi"))), "messages[0].role"),
    ("chat-too-long", _request(messages=chat(("user", "y = 2\n" * 200))), "messages"),
]


def _assert_unharmed(server: ServerThread) -> None:
    wait_until(lambda: idle(server.engine), timeout=10, what="no live state")
    with DSpineClient(server.address, timeout=30) as client:
        assert len(client.generate(token_ids=[1, 2, 3], max_new_tokens=2).token_ids) == 2
    assert idle(server.engine)


def _call(address: str, request_bytes: bytes, stream: bool):
    """Send raw bytes as a GenerateRequest; returns the RpcError."""
    with grpc.insecure_channel(address) as channel:
        if stream:
            method = channel.unary_stream("/dspine.v1.DSpine/GenerateStream",
                                          response_deserializer=pb.GenerateStreamResponse.FromString)
            call = lambda: list(method(request_bytes, timeout=30))  # noqa: E731
        else:
            method = channel.unary_unary("/dspine.v1.DSpine/Generate",
                                         response_deserializer=pb.GenerateResponse.FromString)
            call = lambda: method(request_bytes, timeout=30)  # noqa: E731
        with pytest.raises(grpc.RpcError) as info:
            call()
        return info.value


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("case_id, message, field", CASES, ids=[c[0] for c in CASES])
def test_invalid_argument_names_field(full_server, case_id, message, field, stream):
    error = _call(full_server.address, message.SerializeToString(), stream)
    assert error.code() == INVALID, (case_id, error.details())
    assert error.details().startswith(field), error.details()
    assert dict(error.trailing_metadata())["dspine-field"].startswith(field)
    _assert_unharmed(full_server)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _unknown_varint_field(number: int, value: int = 7) -> bytes:
    return _varint(number << 3) + _varint(value)  # wire type 0


def test_unknown_field_is_invalid(full_server):
    # A newer client's field must not be ignored silently: top level (#99) and nested (sampling.#37).
    raw = _request(token_ids=OK).SerializeToString() + _unknown_varint_field(99)
    error = _call(full_server.address, raw, stream=False)
    assert error.code() == INVALID and error.details().startswith("#99"), error.details()
    sampling = pb.SamplingParams(temperature=0.0).SerializeToString() + _unknown_varint_field(37)
    raw = _request(token_ids=OK).SerializeToString() + _varint(4 << 3 | 2) + _varint(len(sampling)) + sampling
    error = _call(full_server.address, raw, stream=True)
    assert error.code() == INVALID and error.details().startswith("sampling.#37"), error.details()
    _assert_unharmed(full_server)


@pytest.mark.parametrize("raw, field, sent, expected", [
    # request_id (6) is a string: length-delimited, sent as a varint
    (_unknown_varint_field(6), "request_id", "0 (varint)", "2 (length-delimited)"),
    # speculative (5) is a bool: a varint, sent as 32 bits
    (_varint(5 << 3 | 5) + b"\x01\x00\x00\x00", "speculative", "5 (32-bit)", "0 (varint)"),
    # sampling.temperature (1) is a double: 64 bits, sent as a varint
    (_varint(4 << 3 | 2) + _varint(2) + _unknown_varint_field(1, 0), "sampling.temperature", "0 (varint)",
     "1 (64-bit)"),
    # sampling.stop_token_ids (7) is repeated int32: varint or packed, sent as 64 bits
    (_varint(4 << 3 | 2) + _varint(9) + _varint(7 << 3 | 1) + bytes(8), "sampling.stop_token_ids", "1 (64-bit)",
     "0 (varint) or 2 (length-delimited)"),
], ids=["string-as-varint", "bool-as-fixed32", "nested-double-as-varint", "repeated-int-as-fixed64"])
def test_known_field_with_the_wrong_wire_type_is_named(full_server, raw, field, sent, expected):
    # A field this schema has, sent with another wire type, is not "unknown": say which field and what is wrong.
    error = _call(full_server.address, _request(token_ids=OK).SerializeToString() + raw, stream=False)
    assert error.code() == INVALID, error.details()
    assert error.details().startswith(f"{field}: sent with wire type {sent}"), error.details()
    assert f"takes wire type {expected}" in error.details() and "unknown field" not in error.details()
    assert dict(error.trailing_metadata())["dspine-field"] == field
    _assert_unharmed(full_server)


def test_malformed_bytes_and_invalid_utf8(full_server):
    for raw in (b"\x0a\x02\xff\xfe", b"\x12\x05\x08"):  # text with invalid UTF-8; a truncated message
        error = _call(full_server.address, raw, stream=False)
        assert error.code() == INVALID and error.details().startswith("request"), error.details()
    _assert_unharmed(full_server)


def test_oversized_message_is_resource_exhausted(full_server):
    with DSpineClient(full_server.address, timeout=30) as client:
        with pytest.raises(Exception) as info:
            client.generate("z" * (MAX_RECEIVE + 1024), max_new_tokens=2)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    _assert_unharmed(full_server)


def test_duplicate_request_id_in_flight(full_server):
    with DSpineClient(full_server.address, timeout=30) as client:
        stream = client.generate_stream(token_ids=[1, 2], max_new_tokens=40, ignore_eos=True, request_id="dup")
        first = next(stream)
        assert not first.finished
        with pytest.raises(Exception) as info:
            client.generate(token_ids=[1, 2], max_new_tokens=2, request_id="dup")
        assert info.value.code == INVALID and info.value.field == "request_id"
        stream.cancel()
    _assert_unharmed(full_server)


@pytest.mark.parametrize("case_id, message, code, field", [
    ("speculative-without-drafter", _request(token_ids=OK, speculative=True),
     grpc.StatusCode.FAILED_PRECONDITION, "speculative"),
    ("text-without-tokenizer", _request(text="hello"), INVALID, "text"),
    ("chat-without-template", _request(messages=chat(("user", "hi"))), INVALID, "messages"),
    ("stop-strings-without-tokenizer", _request(token_ids=OK, sampling={"stop": ["x"]}), INVALID, "sampling.stop"),
], ids=lambda v: v if isinstance(v, str) and "-" in v else "")
def test_server_capabilities(bare_server, case_id, message, code, field):
    error = _call(bare_server.address, message.SerializeToString(), stream=False)
    assert error.code() == code, error.details()
    assert error.details().startswith(field), error.details()
    _assert_unharmed(bare_server)


def test_chat_without_template(serve, plain_tokenizer):
    server = serve(make_engine(plain_tokenizer, with_drafter=False))
    with DSpineClient(server.address, timeout=30, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(Exception) as info:
            client.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=2)
        assert info.value.code == INVALID and info.value.field == "messages"
        with pytest.raises(Exception) as info:
            client.tokenize(messages=[("user", "hi")])
        assert info.value.code == INVALID and info.value.field == "messages"
        assert client.generate("hi", max_new_tokens=2).finish_reason in ("stop", "length")


def check_tokenize_detokenize_bad_input(client) -> None:
    """Empty text, an id beyond the vocabulary (512) and a negative id: INVALID_ARGUMENT naming each."""
    for call, field in ((lambda: client.tokenize(""), "text"),
                        (lambda: client.detokenize([1, 512]), "token_ids[1]"),
                        (lambda: client.detokenize([-3]), "token_ids[0]")):
        with pytest.raises(Exception) as info:
            call()
        assert info.value.code == INVALID and info.value.field == field, info.value


def test_tokenize_detokenize_bad_input(full_server):
    with DSpineClient(full_server.address, timeout=30) as client:
        check_tokenize_detokenize_bad_input(client)
