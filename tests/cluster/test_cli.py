"""The `dspine` command line on a tiny saved pair (same loaders as any checkpoint)."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
import torch

from dspine.cluster.cli import main
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.models.dspine_checkpoint import init_random_drafter, save_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.loader import save_target
from dspine.replica.models.target import TargetModel
from dspine.replica.models.target_config import TARGET_CONFIGS, TargetArgs
from dspine.training.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target_dir, draft_dir = root / "target", root / "draft"
    tokenizer = train_tokenizer([inspect.getsource(textwrap)], vocab_size=400, out_dir=target_dir)
    torch.manual_seed(0)
    args = TargetArgs(**{**TARGET_CONFIGS["tiny"], "vocab_size": 512,
                         "eos_token_id": (tokenizer.token_to_id("<|endoftext|>"),)})
    target = TargetModel(args)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if param.dim() >= 2 and "conv1d" not in name:
                param.normal_(0.0, 0.08)
    save_target(target, target_dir)
    drafter = init_random_drafter(target, DraftArgs.for_target(args, window=16, num_retrieve=32), seed=0)
    save_drafter(drafter, draft_dir)
    return str(target_dir), str(draft_dir)


def test_info_prints_the_article_figures(capsys):
    assert main(["info", "--draft-preset", "dspine-27b-b16"]) == 0
    out = capsys.readouterr().out
    for figure in ("20,480 B", "160 MiB", "2.5 GiB", "485 MiB", "727.5 MiB"):
        assert figure in out


@pytest.mark.parametrize("spec_flag", [[], ["--no-spec"]], ids=["speculative", "target-only"])
def test_generate_json_equals_the_engine(saved_pair, capsys, spec_flag):
    target_dir, draft_dir = saved_pair
    argv = ["generate", "--target", target_dir, "--draft", draft_dir, "--prompt", "def wrap(text):",
            "--max-new-tokens", "20", "--json", "--device", "cpu", "--dtype", "float32", *spec_flag]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    engine = Engine.from_pretrained(target_dir, draft_dir, EngineConfig(device="cpu", dtype="float32"))
    expected = engine.generate_text("def wrap(text):", SamplingParams(max_new_tokens=20), speculative=not spec_flag)
    assert printed["token_ids"] == expected.token_ids
    assert printed["text"] == expected.text
    assert printed["speculative"] == (not spec_flag)


def test_bench_engine_reports_a_ratio_measured_in_one_run(saved_pair, capsys):
    target_dir, draft_dir = saved_pair
    argv = ["bench", "engine", "--target", target_dir, "--draft", draft_dir, "--num-prompts", "2",
            "--prompt-len", "8", "--max-new-tokens", "12", "--json", "--device", "cpu", "--dtype", "float32",
            "--repeats", "3", "--verify-threshold", "0.3", "--retrieval", "exact", "--no-adaptive"]
    # --no-adaptive: every speculative step drafts, so the histogram holds at least one cycle per
    # prompt however the machine's timings steer the adaptive policy (with it, a slow CI run drafted once).
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_greedy_output"] is True
    assert len(report["target_only_run_seconds"]) == len(report["speculative_run_seconds"]) == 3
    ratios = sorted((report["speculative_tokens"] / s) / (report["target_only_tokens"] / t)
                    for t, s in zip(report["target_only_run_seconds"], report["speculative_run_seconds"]))
    assert report["speedup"] == pytest.approx(ratios[1])  # the median paired ratio
    assert report["target_only_tokens"] == report["speculative_tokens"] == 24
    assert sum(report["accepted_len_histogram"]) >= 2
    assert report["config"]["verify_threshold"] == 0.3 and report["config"]["retrieval"] == "exact"
    assert report["mean_accepted_len"] <= report["mean_verified_len"] <= 15
    assert len(report["gemm_probe_us"]) == 3 and all(p > 0 for p in report["gemm_probe_us"])


def test_missing_target_dir_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--target", str(tmp_path / "nope"), "--prompt", "x", "--no-spec"]) == 2
    assert "nope" in capsys.readouterr().err


def test_train_draft_flags_override_only_what_is_given(monkeypatch):
    from dspine.training import draft as draft_training

    seen = []
    monkeypatch.setattr(draft_training, "train_draft", lambda cfg: seen.append(cfg))
    assert main(["train", "draft", "--target", "t", "--out", "o", "--num-sequences", "512", "--threads", "1"]) == 0
    assert main(["train", "draft", "--target", "t", "--out", "o"]) == 0
    given, defaults = seen
    assert (given.num_sequences, given.threads, given.target_dir, given.out_dir) == (512, 1, "t", "o")
    # Without flags the recipe is DraftTrainConfig's own: the CLI holds no second copy of it.
    assert defaults == draft_training.DraftTrainConfig(target_dir="t", out_dir="o")
    # --recipe sampled is the config module's SAMPLED_RECIPE, with explicit flags on top of it.
    assert main(["train", "draft", "--target", "t", "--out", "o", "--recipe", "sampled", "--steps", "7",
                 "--init-from", "d"]) == 0
    sampled = seen[-1]
    assert sampled == draft_training.DraftTrainConfig(target_dir="t", out_dir="o", steps=7, init_from="d",
                                                      **draft_training.SAMPLED_RECIPE)
    assert sampled.continuation_temperature > 0 and sampled.soft_label_topk > 0


def test_serve_flags_build_the_cluster_config_over_a_config_file(tmp_path):
    import yaml

    from dspine.cluster.cli import build_parser, cluster_config_from_args
    from dspine.cluster.serve_config import SHIPPED_CONFIG

    doc = yaml.safe_load(SHIPPED_CONFIG.read_text())
    doc["applications"][0]["args"]["replicas"]["max_queued_requests"] = 3
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    args = build_parser().parse_args(["serve", "--config", str(path), "--replicas", "3", "--max-concurrency", "4"])
    config = cluster_config_from_args(args)
    assert (config.replicas.num_replicas, config.replicas.max_queued_requests) == (3, 3)  # flag, then file
    assert config.engine.max_concurrency == 4
    assert config.engine_deployment_options()["max_ongoing_requests"] == 4
    defaults = cluster_config_from_args(build_parser().parse_args(["serve"]))
    assert (defaults.grpc_port, defaults.replicas.num_replicas, defaults.engine.max_concurrency) == (9000, 1, 8)


def test_draft_dtype_flag_reaches_the_engine_and_cluster_configs():
    from dspine.cluster.cli import build_parser, cluster_config_from_args
    from dspine.cluster.cli.options import engine_config

    args = build_parser().parse_args(["bench", "engine", "--draft-dtype", "bfloat16", "--dtype", "float32"])
    config = engine_config(args)
    assert (config.torch_dtype, config.torch_draft_dtype) == (torch.float32, torch.bfloat16)
    assert engine_config(build_parser().parse_args(["bench", "engine", "--dtype", "float32"])).torch_draft_dtype \
        == torch.float32  # auto: the target's
    served = cluster_config_from_args(build_parser().parse_args(["serve", "--draft-dtype", "bfloat16"]))
    assert served.engine.engine_config(1).draft_dtype == "bfloat16"
    assert cluster_config_from_args(build_parser().parse_args(["serve"])).engine.engine_config(1).draft_dtype == "auto"
    with pytest.raises(ValueError, match="draft_dtype"):
        EngineConfig(draft_dtype="int8")


def test_serve_cluster_refuses_standalone_only_flags(capsys):
    from dspine.cluster.cli import main

    assert main(["serve", "--auth-token", "x"]) == 2
    assert "terminate them in front of the cluster" in capsys.readouterr().err
    assert main(["serve", "--port", "0"]) == 2


def test_bench_engine_writes_a_perfetto_trace_and_measures_tracing(saved_pair, tmp_path, capsys):
    # --no-adaptive: every speculative step drafts, so the trace has verify stages whatever the
    # adaptive policy would make of this random pair's timings (it may draft nothing in 16 tokens)
    target_dir, draft_dir = saved_pair
    out = tmp_path / "steps.json"
    assert main(["bench", "engine", "--target", str(target_dir), "--draft", str(draft_dir), "--num-prompts", "2",
                 "--prompt-len", "8", "--max-new-tokens", "8", "--repeats", "1", "--trace-out", str(out),
                 "--tracing", "--device", "cpu", "--dtype", "float32", "--no-adaptive"]) == 0
    printed = capsys.readouterr().out
    assert "tracing on / off" in printed and f"wrote {out}" in printed
    events = json.loads(out.read_text())["traceEvents"]
    assert {"verify", "prefill"} <= {e["name"] for e in events}


@pytest.mark.timeout(120)
def test_generate_against_no_server_is_one_clear_line():
    """A server that is not running: one line naming the address and the status, exit 1, no traceback."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "dspine.cluster.cli", "generate", "--server", f"127.0.0.1:{port}",
                           "--prompt", "hi", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("dspine generate: error: UNAVAILABLE")
    assert f"127.0.0.1:{port}" in lines[0]
