"""The standalone server over a real socket: equivalence with the engine, limits, cancel, drain, auth."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading

import grpc
import pytest

from dspine.cluster.client import AsyncDSpineClient, DSpineClient, RetryPolicy
from dspine.cluster.client_errors import (
    Cancelled,
    DeadlineExceeded,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from dspine.replica import SamplingParams

from .conftest import idle, make_engine, wait_until

PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_unary_and_stream_equal_engine(serve, tokenizer, speculative):
    engine = make_engine(tokenizer)
    params = SamplingParams(max_new_tokens=12)
    expected = engine.generate(PROMPT, params, speculative=speculative)
    text = "def wrap(text, width):"
    expected_text = engine.generate(tokenizer.encode(text), params, speculative=speculative)
    server = serve(engine)
    with DSpineClient(server.address, timeout=60) as client:
        result = client.generate(token_ids=PROMPT, max_new_tokens=12, speculative=speculative, request_id="eq-1")
        assert result.request_id == "eq-1"
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text
        assert result.finish_reason == expected.finish_reason
        assert result.usage.prompt_tokens == len(PROMPT)
        assert result.usage.completion_tokens == len(expected.token_ids)
        assert result.speculation.speculative is speculative
        assert (result.speculation.cycles > 0) is speculative
        if speculative:
            assert sum(result.speculation.accepted_len_histogram) == result.speculation.cycles
            assert len(result.speculation.accepted_len_histogram) == engine.block_size

        chunks = list(client.generate_stream(token_ids=PROMPT, max_new_tokens=12, speculative=speculative))
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in chunks) == expected.text
        assert all(c.finish_reason is None for c in chunks[:-1])
        last = chunks[-1]
        assert last.finish_reason == expected.finish_reason
        assert last.usage.completion_tokens == len(expected.token_ids)
        assert last.timings.time_to_first_token > 0

        by_text = client.generate(text, max_new_tokens=12, speculative=speculative)
        assert by_text.token_ids == expected_text.token_ids
        assert by_text.text == expected_text.text
    wait_until(lambda: idle(engine), what="no live state")


def test_chat_tokenize_detokenize_info_health(serve, tokenizer):
    engine = make_engine(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "wrap this text"}]
    rendered = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nwrap this text<|im_end|>\n"
                "<|im_start|>assistant\n")
    chat_ids = tokenizer.encode(rendered, add_special_tokens=False)
    expected = engine.generate(chat_ids, SamplingParams(max_new_tokens=6))
    server = serve(engine, model_name="tiny-random")
    with DSpineClient(server.address, timeout=60) as client:
        assert client.tokenize(messages=messages) == chat_ids
        assert client.generate(messages=messages, max_new_tokens=6).token_ids == expected.token_ids
        ids = client.tokenize("hello world")
        assert ids == tokenizer.encode("hello world")
        assert client.detokenize(ids) == "hello world"
        info = client.info()
        assert (info.target_name, info.target_type, info.vocab_size) == ("tiny-random", "qwen3_5_text", 512)
        assert info.has_drafter and info.block_size == engine.block_size == 16
        assert (info.max_concurrency, info.max_context) == (8, engine.max_seq_len)
        assert info.has_tokenizer and info.has_chat_template
        assert info.eos_token_ids == tuple(tokenizer.eos_token_ids)
        assert client.health() == "SERVING"
        assert client.health("dspine.v1.DSpine") == "SERVING"


def test_generate_names_the_drafter_of_a_two_drafter_engine(serve):
    from dspine.replica import Engine, EngineConfig
    from dspine.replica.models.dspine_checkpoint import init_random_drafter

    one = make_engine()
    sampled = init_random_drafter(one.target, one.drafter.args, seed=1).eval()
    engine = Engine(one.target, one.drafter, None, EngineConfig(device="cpu", dtype="float32", max_seq_len=96,
                                                                adaptive_speculation=False),
                    sampled_drafter=sampled)
    server = serve(engine)
    with DSpineClient(server.address, timeout=60) as client:
        info = client.info()
        assert info.drafters == ("greedy", "sampled") and info.sampled_draft_min_temperature == 0.3
        assert client.generate(token_ids=PROMPT, max_new_tokens=6).speculation.drafter == "greedy"
        hot = client.generate(token_ids=PROMPT, max_new_tokens=6, temperature=0.8, seed=1)
        assert hot.speculation.drafter == "sampled" and hot.speculation.cycles > 0
        chunks = list(client.generate_stream(token_ids=PROMPT, max_new_tokens=6, temperature=0.8, seed=1))
        assert chunks[-1].speculation.drafter == "sampled"
        assert client.generate(token_ids=PROMPT, max_new_tokens=6, speculative=False).speculation.drafter == ""
    wait_until(lambda: idle(engine), what="no live state")


def test_reflection_lists_the_service(serve):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    server = serve(make_engine(with_drafter=False))
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"dspine.v1.DSpine", "grpc.health.v1.Health"} <= names


def test_nine_streams_eighth_full_ninth_refused_cancel_frees_slot(serve, gate_for):
    engine = make_engine()
    gate = gate_for(engine)
    server = serve(engine)

    async def scenario():
        async with AsyncDSpineClient(server.address, timeout=60) as client:
            streams = [client.generate_stream(token_ids=[3 + i, 4, 5], max_new_tokens=20, request_id=f"s{i}")
                       for i in range(8)]
            firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
            await asyncio.to_thread(wait_until, lambda: engine.num_live_states()["requests"] == 8, 20,
                                    "8 admitted")
            gate.allow(1)  # one step: all 8 prefill together and release their first token
            first_chunks = await asyncio.gather(*firsts)
            assert all(len(c.token_ids) == 1 and not c.finished for c in first_chunks)
            full = engine.num_live_states()
            assert full["requests"] == 8 and full["target_states"] == 8 and full["draft_slots"] > 0

            with pytest.raises(ResourceExhausted) as info:  # the 9th: refused at once, nothing admitted
                await client.generate_stream(token_ids=[1, 2], max_new_tokens=4).__anext__()
            assert "max_concurrency=8" in info.value.details
            assert engine.num_live_states() == full

            streams[0].cancel()  # client cancel mid-stream
            with pytest.raises(Cancelled):
                await streams[0].__anext__()
            # The cancel ends the request and frees its slot at once; its device state is freed at the
            # next step boundary, on the device thread (the gate holds steps: the final idle check).
            await asyncio.to_thread(wait_until, lambda: engine.num_unfinished() == 7, 20, "cancel")
            assert engine.load().in_flight == 7

            gate.open()  # the freed slot takes a new request, which runs to the end with the other 7
            newcomer = await client.generate(token_ids=[9, 9, 9], max_new_tokens=5, speculative=False)
            assert newcomer.finish_reason == "length" and len(newcomer.token_ids) == 5
            for stream, first in zip(streams[1:], first_chunks[1:], strict=True):
                rest = [c async for c in stream]
                assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 20
                assert rest[-1].finish_reason == "length"

    asyncio.run(scenario())
    wait_until(lambda: idle(engine), what="no live state")


def test_stream_deadline_cancels_request(serve, gate_for):
    engine = make_engine()
    gate = gate_for(engine)
    server = serve(engine)
    with DSpineClient(server.address) as client:
        stream = client.generate_stream(token_ids=PROMPT, max_new_tokens=50, timeout=1.5)
        wait_until(lambda: engine.num_live_states()["requests"] == 1, what="admission")
        gate.allow(2)  # prefill and one cycle at most: the request cannot finish before its deadline
        with pytest.raises(DeadlineExceeded):
            for _ in stream:
                pass
        wait_until(lambda: engine.num_unfinished() == 0, what="deadline frees the slot")
        gate.open()  # the next step boundary frees its device state, on the device thread
        wait_until(lambda: idle(engine), what="deadline frees the device state")
        assert client.generate(token_ids=PROMPT, max_new_tokens=3, timeout=30).finish_reason == "length"


def test_graceful_shutdown_drains_in_flight_and_refuses_new(serve, gate_for):
    engine = make_engine()
    gate = gate_for(engine)
    server = serve(engine)
    with DSpineClient(server.address, timeout=60, retry=RetryPolicy(max_attempts=1)) as client:
        stream = client.generate_stream(token_ids=PROMPT, max_new_tokens=10, ignore_eos=True)
        received = []
        reader = threading.Thread(target=lambda: received.extend(stream))
        reader.start()
        wait_until(lambda: engine.num_live_states()["requests"] == 1, what="admission")
        stopping = server.submit(server.server.stop(grace=30.0))
        wait_until(lambda: client.health() == "NOT_SERVING", what="NOT_SERVING")
        with pytest.raises(Unavailable, match="shutting down"):
            client.generate(token_ids=PROMPT, max_new_tokens=2)
        with pytest.raises(Unavailable):
            next(iter(client.generate_stream(token_ids=PROMPT, max_new_tokens=2)))
        assert not stopping.done()
        gate.open()
        reader.join(30)
        stopping.result(30)
    assert sum(len(c.token_ids) for c in received) == 10
    assert received[-1].finish_reason == "length"
    assert idle(engine)


def test_bearer_token(serve):
    engine = make_engine(with_drafter=False)
    server = serve(engine, auth_token="s3cret")
    for token in (None, "wrong"):
        with DSpineClient(server.address, token=token, timeout=10) as client:
            with pytest.raises(Unauthenticated):
                client.generate(token_ids=PROMPT, max_new_tokens=2)
            with pytest.raises(Unauthenticated):
                next(iter(client.generate_stream(token_ids=PROMPT, max_new_tokens=2)))
            assert client.health() == "SERVING"  # probes need no secret
    with DSpineClient(server.address, token="s3cret", timeout=30) as client:
        assert len(client.generate(token_ids=PROMPT, max_new_tokens=2).token_ids) == 2
        assert client.info().max_concurrency == 8


def test_bearer_scheme_is_case_insensitive_and_unknown_methods_stay_hidden(serve):
    import grpc

    server = serve(make_engine(with_drafter=False), auth_token="s3cret")
    with grpc.insecure_channel(server.address) as channel:
        nowhere = channel.unary_unary("/dspine.v1.DSpine/NoSuchMethod")
        info = channel.unary_unary("/dspine.v1.DSpine/GetModelInfo")
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as refused:  # not UNIMPLEMENTED: names stay secret
                nowhere(b"", metadata=metadata, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as unknown:  # an authorized caller learns it does not exist
            nowhere(b"", metadata=(("authorization", "bearer s3cret"),), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert info(b"", metadata=(("authorization", f"{scheme} s3cret"),), timeout=10) is not None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a self-signed cert")
def test_tls(serve, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = serve(make_engine(with_drafter=False), tls_cert=cert, tls_key=key, auth_token="t")
    with DSpineClient(server.address, root_certificates=cert.read_bytes(), token="t", timeout=30) as client:
        assert len(client.generate(token_ids=PROMPT, max_new_tokens=2).token_ids) == 2
    with DSpineClient(server.address, token="t", timeout=5, retry=RetryPolicy(max_attempts=1)) as plain:
        with pytest.raises(Unavailable):
            plain.info()


def test_async_client_task_cancel_frees_slot(serve, gate_for, tokenizer):
    engine = make_engine(tokenizer)
    gate = gate_for(engine)
    server = serve(engine)

    async def scenario():
        async with AsyncDSpineClient(server.address, timeout=60) as client:
            async def consume():
                async for _ in client.generate_stream(token_ids=PROMPT, max_new_tokens=30):
                    pass

            reader = asyncio.ensure_future(consume())
            await asyncio.to_thread(wait_until, lambda: engine.num_live_states()["requests"] == 1, 20, "admit")
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            await asyncio.to_thread(wait_until, lambda: idle(engine), 20, "task cancel frees the slot")
            gate.open()
            result = await client.generate("def f(x):", max_new_tokens=4, ignore_eos=True)
            assert result.finish_reason == "length" and len(result.token_ids) == 4
            assert await client.tokenize("abc") == tokenizer.encode("abc")
            assert (await client.info()).vocab_size == 512
            assert await client.health() == "SERVING"

    asyncio.run(scenario())


def test_a_request_that_does_not_fit_the_draft_pool_is_resource_exhausted_naming_it(serve, gate_for):
    # 40 draft slots; each request below reserves 20 + 10 = 30 of them
    engine = make_engine(draft_pool_tokens=41, admission_when_full="refuse")
    gate = gate_for(engine)
    server = serve(engine)
    engine.add_request([3] * 20, SamplingParams(max_new_tokens=10, ignore_eos=True), speculative=True)
    with DSpineClient(server.address, timeout=60, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(ResourceExhausted, match="draft KV pool is full: the request needs 30 tokens, 10 of 40"):
            client.generate(token_ids=[4] * 20, max_new_tokens=10, speculative=True)
        with pytest.raises(ResourceExhausted, match="draft KV pool can never hold"):
            client.generate(token_ids=[3] * 40, max_new_tokens=10, speculative=True)
        gate.open()
        wait_until(lambda: engine.num_unfinished() == 0, what="the first request done")
        done = client.generate(token_ids=[4] * 20, max_new_tokens=10, speculative=True, ignore_eos=True)
        assert done.finish_reason == "length"
    wait_until(lambda: idle(engine), what="no live state")
