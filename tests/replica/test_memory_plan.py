"""The memory plan: the article's figures, every other line recomputed from the configs, the CLI's
exit status, and the engine refusing to start when the plan does not fit."""

from __future__ import annotations

import pytest

from dspine.cluster.cli import main
from dspine.replica import EngineConfig
from dspine.replica.memory_plan import MemoryPlanError, PlanConfig, parse_size, plan_memory
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.target_config import TargetArgs

MiB, GiB = 1 << 20, 1 << 30
TARGET = TargetArgs.from_name("Qwen3.8-27B")
DRAFTER = DraftArgs.from_name("dspine-27b-b16")


def _plan(max_seq_len=8192, pool="dense", **kw):
    return plan_memory(TARGET, DRAFTER, PlanConfig(parse_size("141GB"), 8, max_seq_len, pool, **kw))


def test_draft_side_figures_are_the_articles():
    plan = _plan()
    # 20,480 B per position; 8 requests x 8,192 positions + the padding slot
    assert plan.line("draft pool").bytes == 20_480 * (8 * 8192 + 1)
    assert 20_480 * 8192 == 160 * MiB and 20_480 * 131_072 == int(2.5 * GiB)
    assert _plan(131_072).line("draft pool").bytes == 20_480 * (8 * 131_072 + 1)  # 8 x 2.5 GiB (dense)
    assert _plan(131_072, "ring").line("draft pool").bytes == 20_480 * (8 * 8192 + 1)  # the window only
    assert plan.line("codebook").bytes == 485 * MiB
    assert plan.line("tail tables").bytes == int(727.5 * MiB) + 512 * 512 * 4  # + the [M, M] fp32 gram


def test_target_lines_recomputed_from_the_config():
    plan = _plan()
    # weights: an independent count of the Qwen3.5 layout (16 gated full-attention + 48 GDN layers)
    H, I, V = 5120, 17_408, 248_320
    attention = H * 24 * 256 * 2 + 2 * H * 4 * 256 + 24 * 256 * H + 2 * 256
    conv_dim = 2 * 16 * 128 + 48 * 128
    gdn = H * conv_dim + H * 48 * 128 + 2 * H * 48 + conv_dim * 4 + 2 * 48 + 128 + 48 * 128 * H
    per_layer = 3 * H * I + 2 * H
    params = 2 * V * H + H + 16 * (attention + per_layer) + 48 * (gdn + per_layer)
    assert plan.line("target weights").bytes == 2 * params
    # K/V of the 16 full-attention layers only: 2 x 16 x 4 x 256 x 2 B per position
    assert plan.line("target K/V").bytes == 65_536 * 8 * 8192 == 4 * GiB
    assert _plan(131_072).line("target K/V").bytes == 64 * GiB
    state = 48 * conv_dim * 3 * 2 + 48 * 48 * 128 * 128 * 4  # conv (bf16) + recurrent (fp32)
    assert plan.line("GDN states").bytes == 8 * 2 * state  # committed + pending
    replay = 48 * (conv_dim * 2 + 4 * 48 * (128 + 128 + 2))
    assert plan.line("GDN verify commit").bytes == 8 * 16 * replay
    assert _plan(verify_keeps="states").line("GDN verify commit").bytes == 8 * 16 * state
    assert plan.line("retrieval head copy").bytes == V * H + 4 * V  # e4m3 copy + fp32 row scales
    assert plan.total_bytes == sum(line.bytes for line in plan.lines)
    assert plan.left_bytes == 141 * 10**9 - plan.total_bytes


def test_reference_fits_at_8k_and_only_the_ring_fits_at_128k():
    assert _plan().fits and _plan(pool="ring").fits
    assert not _plan(131_072).fits  # 64 GiB target K/V + 20 GiB dense draft pool
    assert _plan(131_072, "ring").fits


def test_cli_plan_exit_status(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "8 requests x 8,192 positions, dense draft pool" in out and "fits" in out
    assert main(["plan", "--max-seq-len", "131072"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", "--max-seq-len", "131072", "--draft-pool", "ring"]) == 0


def test_parse_size_names_the_field():
    assert parse_size("141GB") == 141 * 10**9 and parse_size("2GiB") == 2 * GiB and parse_size("512") == 512
    with pytest.raises(ValueError, match="device_memory"):
        parse_size("lots")


def test_engine_refuses_to_start_when_the_plan_does_not_fit(hybrid_target, build):
    with pytest.raises(MemoryPlanError, match="does not fit|short"):
        build.engine(hybrid_target, device_memory=1 * MiB)
    engine = build.engine(hybrid_target, device_memory=4 * GiB)
    assert engine.memory_plan.fits
    # the check can be turned off; the plan is still there to read
    assert not build.engine(hybrid_target, device_memory=1 * MiB, memory_check=False).memory_plan.fits


def test_from_pretrained_refuses_before_loading(monkeypatch):
    from dspine import embedded
    from dspine.replica import Engine
    from dspine.replica.models import loader

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the plan was checked")

    monkeypatch.setattr(loader, "load_target", no_load)
    with pytest.raises(MemoryPlanError):
        Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR,
                               EngineConfig(device="cpu", device_memory=16 * MiB))


def test_readme_shows_the_plans_as_computed():
    from pathlib import Path

    from dspine.replica.memory_plan import _fmt

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for line in _plan().format().splitlines()[1:]:
        assert line in readme, line
    for flags, plan in (("(8 x 8,192, dense)", _plan()), ("`--draft-pool ring`", _plan(pool="ring")),
                        ("`--max-seq-len 131072`", _plan(131_072)),
                        ("`--max-seq-len 131072 --draft-pool ring`", _plan(131_072, "ring"))):
        row = (f"| {flags} | {_fmt(plan.line('target K/V').bytes)} | {_fmt(plan.line('draft pool').bytes)} | "
               f"{_fmt(plan.total_bytes)} | {_fmt(plan.left_bytes)} | {0 if plan.fits else 1} |")
        assert row in readme, row
