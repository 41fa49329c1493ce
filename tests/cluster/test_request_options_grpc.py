"""Request options over a real socket (SDK sync + async, CLI): the engine's tokens and logprobs arrive
unchanged; bad values are INVALID_ARGUMENT naming the field (more cases in test_bad_input.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from dspine.cluster.cli import main
from dspine.cluster.client import AsyncDSpineClient, DSpineClient
from dspine.cluster.client_errors import InvalidArgument
from dspine.replica import SamplingParams

from .conftest import make_engine

PROMPT = [5, 6, 7, 8]
OPTIONS = dict(temperature=0.8, seed=11, min_p=0.01, repetition_penalty=1.3, presence_penalty=0.4,
               frequency_penalty=0.2, logit_bias={9: 2.5, 4: -3.0}, logprobs=3, reproducible=True)


def test_options_and_logprobs_reach_the_client_unchanged(serve, tokenizer):
    engine = make_engine(tokenizer)
    expected = engine.generate(PROMPT, SamplingParams(max_new_tokens=10, **OPTIONS), speculative=True)
    server = serve(engine)
    with DSpineClient(server.address, timeout=60) as client:
        result = client.generate(token_ids=PROMPT, max_new_tokens=10, speculative=True, **OPTIONS)
        assert result.token_ids == expected.token_ids
        assert [(e.token_id, e.top) for e in result.logprobs] == [(e.token_id, e.top) for e in expected.logprobs]
        assert [e.logprob for e in result.logprobs] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-6)
        chunks = list(client.generate_stream(token_ids=PROMPT, max_new_tokens=10, speculative=False, **OPTIONS))
        assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
        # reproducible mode: target-only over the wire gives the speculative engine's tokens
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        plain = client.generate(token_ids=PROMPT, max_new_tokens=3)
        assert plain.logprobs is None
        with pytest.raises(InvalidArgument) as info:
            client.generate(token_ids=PROMPT, logit_bias={10**6: 1.0})
        assert info.value.field == "sampling.logit_bias"
        with pytest.raises(InvalidArgument) as info:
            client.generate(token_ids=PROMPT, repetition_penalty=float("nan"))
        assert info.value.field == "sampling.repetition_penalty"

    async def run_async():
        async with AsyncDSpineClient(server.address, timeout=60) as client:
            return await client.generate(token_ids=PROMPT, max_new_tokens=10, speculative=True, **OPTIONS)

    assert asyncio.run(run_async()).token_ids == expected.token_ids


def test_cli_flags(serve, tokenizer, capsys):
    engine = make_engine(tokenizer)
    text = "def wrap(text):"
    params = SamplingParams(max_new_tokens=8, **{**OPTIONS, "logit_bias": {9: 2.5}})
    expected = engine.generate(tokenizer.encode(text), params, speculative=True)
    server = serve(engine)
    argv = ["generate", "--server", server.address, "--prompt", text, "--max-new-tokens", "8", "--json",
            "--temperature", "0.8", "--seed", "11", "--min-p", "0.01", "--repetition-penalty", "1.3",
            "--presence-penalty", "0.4", "--frequency-penalty", "0.2", "--logit-bias", "9=2.5", "--logprobs", "3",
            "--reproducible"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == expected.token_ids
    assert [e["token_id"] for e in printed["logprobs"]] == expected.token_ids
    assert [len(e["top"]) for e in printed["logprobs"]] == [3] * len(expected.token_ids)
    with pytest.raises(SystemExit, match="--logit-bias"):
        main(argv[:-7] + ["--logit-bias", "9:2.5"])
