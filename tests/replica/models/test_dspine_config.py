"""DraftArgs presets and the memory report against the article's numbers."""
from __future__ import annotations

import pytest

from dspine.replica.models.dspine_config import (
    MiB, DraftArgs, format_memory_report, info_text, memory_report,
)
from dspine.replica.models.target_config import TargetArgs


def test_27b_preset_matches_article():
    a = DraftArgs.from_name("dspine-27b-b16")
    assert (a.block_size, a.feature_layers, a.hidden_size, a.intermediate_size) == (16, (1, 16, 31, 46, 61), 5120, 17_408)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.num_layers, a.window) == (32, 8, 128, 5, 8192)
    assert (a.rope_base, a.code_dim, a.message_dim, a.head_topk, a.num_retrieve, a.vocab_size) == (
        1e7, 1024, 512, 16, 128, 248_320)
    assert a.q_dim == 4096 and a.fused_dim == 25_600 and a.num_proposals == 15


def test_memory_report_matches_article_exactly():
    r = memory_report(DraftArgs.from_name("dspine-27b-b16"))
    assert r.kv_bytes_per_position == 20_480
    assert r.kv_bytes_window == 160 * MiB
    assert r.kv_bytes_long_context == 2.5 * 1024 * MiB
    assert r.codebook_bytes == 485 * MiB
    assert r.tail_table_bytes == 727.5 * MiB
    text = format_memory_report(r)
    for s in ("20,480 B", "160 MiB", "2.5 GiB", "485 MiB", "727.5 MiB"):
        assert s in text


def test_info_text_names_preset_and_numbers():
    text = info_text("dspine-27b-b16")
    assert "dspine-27b-b16" in text and "20,480 B" in text and "727.5 MiB" in text


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="dspine-27b-b16"):
        DraftArgs.from_name("nope")


def test_for_target_matches_vocab_hidden_and_taps():
    t = TargetArgs.from_name("tiny")
    a = DraftArgs.for_target(t, num_layers=1)
    assert (a.vocab_size, a.hidden_size, a.feature_layers, a.num_layers) == (512, 64, (0, 1, 2), 1)
    a27 = DraftArgs.for_target(TargetArgs.from_name("Qwen3.8-27B").__class__(feature_layers=()), "dspine-27b-b16")
    assert a27.feature_layers == (1, 16, 31, 46, 61)  # derived spread on 64 layers reproduces the release


def test_config_round_trip_and_validation():
    a = DraftArgs.from_name("tiny", window=7)
    assert DraftArgs.from_config(a.to_config()) == a
    with pytest.raises(ValueError, match="model_type"):
        DraftArgs.from_config({**a.to_config(), "model_type": "llama"})
    with pytest.raises(ValueError, match="num_kv_heads"):
        DraftArgs.from_name("tiny", num_kv_heads=3)
    with pytest.raises(AttributeError):
        a.window = 3  # frozen
