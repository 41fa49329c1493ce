"""The command line with two drafters: --sampled-draft, the threshold flag, the embedded default."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
import torch

from dspine import embedded
from dspine.cluster.cli import build_parser, cluster_config_from_args, main
from dspine.cluster.embedded import resolve_sampled_draft_dir
from dspine.replica.models.dspine_checkpoint import init_random_drafter, save_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.loader import save_target
from dspine.replica.models.target import TargetModel
from dspine.replica.models.target_config import TARGET_CONFIGS, TargetArgs
from dspine.training.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def saved_trio(tmp_path_factory):
    """A tiny saved target, its drafter, a second drafter of the same geometry and one of another."""
    root = tmp_path_factory.mktemp("trio")
    tokenizer = train_tokenizer([inspect.getsource(textwrap)], vocab_size=400, out_dir=root / "target")
    torch.manual_seed(0)
    args = TargetArgs(**{**TARGET_CONFIGS["tiny"], "vocab_size": 512,
                         "eos_token_id": (tokenizer.token_to_id("<|endoftext|>"),)})
    target = TargetModel(args)
    save_target(target, root / "target")
    geometry = DraftArgs.for_target(args, window=16, num_retrieve=32)
    save_drafter(init_random_drafter(target, geometry, seed=0), root / "draft")
    save_drafter(init_random_drafter(target, geometry, seed=1), root / "draft-sampled")
    save_drafter(init_random_drafter(target, DraftArgs.for_target(args, window=8, num_retrieve=32), seed=2),
                 root / "draft-other")
    return {name: str(root / name) for name in ("target", "draft", "draft-sampled", "draft-other")}


def _generate(saved_trio, capsys, *flags) -> dict:
    argv = ["generate", "--target", saved_trio["target"], "--draft", saved_trio["draft"], "--prompt", "def wrap(",
            "--max-new-tokens", "6", "--json", "--device", "cpu", "--dtype", "float32", "--no-adaptive", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_prints_the_drafter_the_temperature_picked(saved_trio, capsys):
    two = ["--sampled-draft", saved_trio["draft-sampled"]]
    assert _generate(saved_trio, capsys, *two)["drafter"] == "greedy"
    assert _generate(saved_trio, capsys, *two, "--temperature", "0.8", "--seed", "1")["drafter"] == "sampled"
    above = ["--sampled-draft-min-temperature", "0.9", "--temperature", "0.8", "--seed", "1"]
    assert _generate(saved_trio, capsys, *two, *above)["drafter"] == "greedy"
    # one drafter: every speculative request says greedy; target-only says nothing
    assert _generate(saved_trio, capsys, "--temperature", "0.8", "--seed", "1")["drafter"] == "greedy"
    assert _generate(saved_trio, capsys, "--no-spec")["drafter"] == ""


def test_a_sampled_drafter_of_another_geometry_is_one_clear_error(saved_trio, capsys):
    argv = ["generate", "--target", saved_trio["target"], "--draft", saved_trio["draft"], "--prompt", "x",
            "--sampled-draft", saved_trio["draft-other"], "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sampled_draft_dir" in err and "window" in err


def test_serve_flags_reach_the_cluster_and_engine_configs():
    args = build_parser().parse_args(["serve", "--target", "t", "--draft", "d", "--sampled-draft", "s",
                                      "--sampled-draft-min-temperature", "0.5"])
    config = cluster_config_from_args(args)
    assert (config.model.draft_dir, config.model.sampled_draft_dir) == ("d", "s")
    assert config.engine.engine_config(1).sampled_draft_min_temperature == 0.5
    defaults = cluster_config_from_args(build_parser().parse_args(["serve"]))
    assert defaults.model.sampled_draft_dir is None
    assert defaults.engine.engine_config(1).sampled_draft_min_temperature == 0.3
    with pytest.raises(ValueError, match="sampled_draft_min_temperature"):
        cluster_config_from_args(build_parser().parse_args(["serve", "--sampled-draft-min-temperature", "0"]))


def test_the_embedded_sampled_drafter_is_the_default_only_beside_the_embedded_pair(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded, "SAMPLED_DRAFT_DIR", tmp_path / "draft-sampled")
    assert resolve_sampled_draft_dir(None, None, None) is None  # not shipped: one drafter, as before
    (tmp_path / "draft-sampled").mkdir()
    (tmp_path / "draft-sampled" / "config.json").write_text("{}")
    if embedded.available():
        assert resolve_sampled_draft_dir(None, None, None) == str(tmp_path / "draft-sampled")
    assert resolve_sampled_draft_dir(None, "my-draft", None) is None  # a drafter of the user's own: no pairing
    assert resolve_sampled_draft_dir("t", "d", None) is None
    assert resolve_sampled_draft_dir("t", "d", "s") == "s"


def test_plan_counts_the_sampled_drafter(saved_trio, capsys):
    base = ["plan", "--target", saved_trio["target"], "--draft", saved_trio["draft"], "--json"]
    assert main(base) == 0
    one = {line["name"] for line in json.loads(capsys.readouterr().out)["lines"]}
    assert main([*base, "--sampled-draft", saved_trio["draft-sampled"]]) == 0
    two = json.loads(capsys.readouterr().out)["lines"]
    assert {line["name"] for line in two} - one == {"sampled drafter"}
    assert main([*base, "--sampled-draft", saved_trio["draft-other"]]) == 2
    assert "window" in capsys.readouterr().err
