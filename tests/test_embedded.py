"""The shipped tiny pair: present in the installation, loaded through the ordinary loaders,
lossless on the held-out prompts the engine benchmark uses."""

from __future__ import annotations

import json

import pytest
import torch

from dspine import embedded
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.bench import heldout_prompts


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
