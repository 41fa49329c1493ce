"""Property-based fuzzing of request validation over a real socket (hypothesis)."""

from __future__ import annotations

import re

import grpc
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from dspine.cluster.client import DSpineClient
from dspine.cluster.server import ServerConfig
from dspine.cluster.validation import ValidationLimits
from dspine.protos.dspine.v1 import dspine_pb2 as pb
from dspine.protos.dspine.v1 import dspine_pb2_grpc as pb_grpc

from .conftest import ServerThread, idle, make_engine, wait_until

INT64 = st.integers(-(2**63), 2**63 - 1)
FIELD = re.compile(r"^(prompt|text|token_ids|messages(\[\d+\]\.(role|content))?|request_id|speculative"
                   r"|sampling\.(temperature|top_k|top_p|seed|max_new_tokens|stop|stop_token_ids|ignore_eos)): ")

chars = st.characters(blacklist_categories=("Cs",))  # proto3 strings are UTF-8: no lone surrogates
texts = st.text(chars, max_size=40)
floats = st.floats(allow_nan=True, allow_infinity=True)
valid_ids = st.lists(st.integers(0, 511), min_size=1, max_size=6)
wild_ids = st.lists(st.one_of(st.integers(0, 600), INT64), max_size=8)
roles = st.sampled_from(["user", "system", "assistant", "tool"])
wild_roles = st.one_of(roles, texts)

# Per field: a valid strategy and a wild one (out of range, NaN, huge, odd strings).
FIELDS = {
    "temperature": (st.floats(0.0, 2.0), floats),
    "top_p": (st.floats(0.05, 1.0), floats),
    "top_k": (st.integers(0, 50), INT64),
    "seed": (st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    # valid lengths stay tiny so the suite stays fast
    "max_new_tokens": (st.integers(1, 3), st.one_of(st.integers(-(2**63), 0), st.integers(97, 2**63 - 1))),
    "stop": (st.lists(st.text(chars, min_size=1, max_size=5), max_size=3),
             st.lists(st.text(chars, max_size=300), max_size=18)),
    "stop_token_ids": (st.lists(st.integers(0, 511), max_size=3), st.lists(st.one_of(st.integers(0, 600), INT64),
                                                                          max_size=3)),
    "request_id": (st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True)),
                   st.text(chars, max_size=140)),
}


@st.composite
def requests(draw) -> pb.GenerateRequest:
    """Mostly-valid requests with zero to two wild fields (the prompt counts as one)."""
    wild = draw(st.sets(st.sampled_from(["prompt", *FIELDS]), max_size=2))
    request = pb.GenerateRequest()
    kind = draw(st.sampled_from(["none", "text", "token_ids", "messages"] if "prompt" in wild
                                else ["text", "token_ids", "messages"]))
    if kind == "text":
        request.text = draw(texts if "prompt" in wild else st.text(chars, min_size=1, max_size=20))
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(wild_ids if "prompt" in wild else valid_ids))
    elif kind == "messages":
        request.messages.SetInParent()
        pairs = st.lists(st.tuples(wild_roles, texts), max_size=3) if "prompt" in wild else \
            st.lists(st.tuples(roles, texts), min_size=1, max_size=2)
        for role, content in draw(pairs):
            request.messages.messages.add(role=role, content=content)
    s = request.sampling
    for name, (valid, wild_values) in FIELDS.items():
        if name not in wild and draw(st.booleans()):
            continue  # unset: the server's default
        value = draw(wild_values if name in wild else valid)
        target = request if name == "request_id" else s
        if isinstance(value, list):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    s.ignore_eos = draw(st.booleans())
    speculative = draw(st.one_of(st.none(), st.booleans()))
    if speculative is not None:
        request.speculative = speculative
    return request


@pytest.fixture(scope="module")
def fuzz_server(tokenizer):
    """One server for every example (and the check after them); unset max_new_tokens means 3."""
    engine = make_engine(tokenizer, max_seq_len=96)
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0),
                          ValidationLimits.from_engine(engine, default_max_new_tokens=3))
    yield server
    server.close()


@settings(max_examples=60, deadline=None)
@given(request=requests())
def test_fuzzed_requests_never_crash_or_leak(fuzz_server, request):
    with grpc.insecure_channel(fuzz_server.address) as channel:
        stub = pb_grpc.DSpineStub(channel)
        try:
            response = stub.Generate(request, timeout=60)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert FIELD.match(e.details()), e.details()
            event(f"rejected: {e.details().split(':')[0]}")
        else:
            event("accepted")
            assert response.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
            assert 1 <= len(response.token_ids) <= 3 or response.finish_reason == pb.FINISH_REASON_STOP
    wait_until(lambda: idle(fuzz_server.engine), timeout=10, what="no live state")


def test_server_serves_after_fuzzing(fuzz_server):
    with DSpineClient(fuzz_server.address, timeout=30) as client:
        assert client.generate(token_ids=[1, 2, 3], max_new_tokens=2, ignore_eos=True).finish_reason == "length"
    assert idle(fuzz_server.engine)
