"""The shipped tiny pair: present in the installation, loaded through the ordinary loaders,
lossless on the held-out prompts the engine benchmark uses."""

from __future__ import annotations

import json

import pytest
import torch

from dspine import embedded
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.benchmarks.prompts import heldout_prompts


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    assert embedded.available(), "the embedded pair must ship as package data"
    return Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, EngineConfig(device="cpu", dtype="float32"))


def test_shipped_pair_uses_the_checkpoint_formats(engine):
    target_config = json.loads((embedded.TARGET_DIR / "config.json").read_text())
    draft_config = json.loads((embedded.DRAFT_DIR / "config.json").read_text())
    assert target_config["model_type"] == "qwen3_5_text"
    assert draft_config["model_type"] == "dspine"
    assert engine.tokenizer is not None and engine.drafter is not None
    assert engine.drafter.lm_head_weight is engine.target.lm_head_weight  # shared, never copied
    size = sum(p.stat().st_size for d in (embedded.TARGET_DIR, embedded.DRAFT_DIR) for p in d.iterdir())
    assert size < 30 * 2**20


def test_greedy_speculation_is_lossless_on_the_bench_prompts(engine):
    # `dspine bench engine`'s default setting: 8 held-out prompts of 64 tokens, 128 new tokens
    prompts = heldout_prompts(engine, num_prompts=8, prompt_len=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    target_only = engine.generate_many(prompts, params, speculative=False)
    speculative = engine.generate_many(prompts, params, speculative=True)  # adaptive speculation on
    for a, b in zip(target_only, speculative):
        assert a.token_ids == b.token_ids
    # The shipped drafter's acceptance (issue 5 asks for >= 3.0; it measures 3.88 on x86-64), with
    # every request drafting every step: the adaptive policy verifies fewer rows at batch 8.
    fixed = Engine(engine.target, engine.drafter, engine.tokenizer,
                   EngineConfig(device="cpu", dtype="float32", adaptive_speculation=False))
    speculative = fixed.generate_many(prompts, params, speculative=True)
    for a, b in zip(target_only, speculative):
        assert a.token_ids == b.token_ids
    cycles = sum(r.stats.spec.num_cycles for r in speculative)
    accepted = sum(r.stats.spec.num_accepted_tokens for r in speculative)
    assert accepted / cycles >= 3.0


def test_generate_text_reads_like_python(engine):
    result = engine.generate_text("def main():\n", SamplingParams(max_new_tokens=24))
    assert result.text and result.finish_reason in ("length", "stop")


def test_embedded_tokenizer_ships_the_chat_template_the_train_command_writes(engine, tmp_path):
    from dspine.training.tokenizer import train_tokenizer

    # `dspine train target` writes tokenizer_config.json through train_tokenizer: the rebuilt file,
    # chat template included, is byte-identical to the shipped one (it does not depend on the corpus)
    train_tokenizer(["def f(x):\n    return x\n"], vocab_size=300, out_dir=tmp_path)
    shipped = (embedded.TARGET_DIR / "tokenizer_config.json").read_bytes()
    assert (tmp_path / "tokenizer_config.json").read_bytes() == shipped
    assert engine.tokenizer.chat_template == json.loads(shipped)["chat_template"]


def test_messages_requests_work_on_the_embedded_pair(engine):
    from dspine.cluster.chat import ChatTemplate
    from dspine.cluster.prompt import prepare_generate
    from dspine.cluster.validation import ValidationLimits, validate_generate

    limits = ValidationLimits.from_engine(engine)
    assert limits.has_chat_template
    messages = [{"role": "system", "content": "Utilities for lists."},
                {"role": "user", "content": "Return the largest\nelement of xs."}]
    request = validate_generate({"messages": messages, "sampling": {"max_new_tokens": 24}}, limits)
    template = ChatTemplate(engine.tokenizer.chat_template)
    assert template.render(messages) == "# Utilities for lists.\n# Return the largest\n# element of xs.\n"
    prepared = prepare_generate(request, limits, engine.tokenizer, template)
    assert engine.tokenizer.decode(prepared.prompt_token_ids) == template.render(messages)
    result = engine.generate(prepared.prompt_token_ids, prepared.params)
    assert result.token_ids and result.text
