"""The engine's description: the one view of an engine that the gRPC edge reads (issue 20, item 6)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dspine.cluster.chat import ChatTemplate
from dspine.cluster.service import DSpineService
from dspine.replica.description import EngineDescription, describe_engine, resolve_eos_token_ids

from .conftest import VOCAB, make_engine

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def test_describe_engine_reports_model_limits_and_tokenizer_face(tokenizer):
    engine = make_engine(tokenizer, max_seq_len=80, max_concurrency=3)
    desc = describe_engine(engine)
    assert isinstance(desc, EngineDescription)
    assert (desc.model_type, desc.vocab_size, desc.max_context) == ("qwen3_5_text", VOCAB, 80)
    assert (desc.block_size, desc.max_concurrency, desc.has_drafter, desc.speculative_default) == (16, 3, True, True)
    assert desc.tokenizer is tokenizer and desc.has_tokenizer and desc.has_chat_template
    assert desc.eos_token_ids == tokenizer.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)
    assert (desc.bos_token, desc.eos_token) == ("", "<|im_end|>")  # the test tokenizer has no BOS
    with pytest.raises(dataclasses.FrozenInstanceError):
        desc.vocab_size = 1


def test_description_without_drafter_or_tokenizer():
    engine = make_engine(with_drafter=False)
    desc = describe_engine(engine)
    assert (desc.block_size, desc.has_drafter, desc.speculative_default) == (0, False, False)
    assert desc.tokenizer is None and not desc.has_tokenizer and not desc.has_chat_template
    assert (desc.bos_token, desc.eos_token, desc.chat_template) == ("", "", None)
    assert desc.eos_token_ids == tuple(engine.target.args.eos_token_id)


def test_eos_rule_prefers_the_tokenizer_over_the_target_config(tokenizer):
    class Args:
        eos_token_id = (7, 9)

    assert resolve_eos_token_ids(None, Args()) == (7, 9)
    assert resolve_eos_token_ids(tokenizer, Args()) == tokenizer.eos_token_ids != (7, 9)
    assert resolve_eos_token_ids(None, object()) == ()


def test_tokenizer_special_token_texts(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    assert tokenizer.id_to_token(eos) == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token is None
    assert tokenizer.id_to_token(10**6) is None


def test_the_service_uses_engine_describe_when_the_engine_has_one(tokenizer):
    # The edge's limits, model info and chat template come from the description alone.
    engine = make_engine(tokenizer)
    real = describe_engine(engine)
    engine.describe = lambda: dataclasses.replace(real, vocab_size=300, model_type="described", eos_token="<E>",
                                                  chat_template="{{ eos_token }}")
    service = DSpineService(engine)
    try:
        assert service.limits.vocab_size == 300
        assert isinstance(service.chat_template, ChatTemplate)
        assert service.chat_template.render([{"role": "user", "content": "x"}]) == "<E>"
        import asyncio

        info = asyncio.run(service.model_info())
        assert (info.target_type, info.vocab_size) == ("described", 300)
    finally:
        engine.shutdown(drain=False)
        service.close()


def test_the_edge_reads_no_engine_internals():
    # Only the description reads them (replica/description.py); a regression shows up as one of these.
    internals = re.compile(r"\.target\.args|engine\.drafter|engine\.config\b|\.tokenizer\.tokenizer|tok\.tokenizer"
                           r"|engine\.block_size|engine\.max_seq_len")
    offenders = [f"{path.name}:{n}" for path in sorted(CLUSTER.glob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if internals.search(line)]
    assert not offenders, offenders
