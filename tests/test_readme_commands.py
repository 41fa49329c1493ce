"""The README's local commands, run as a user runs them (the installed `dspine` console script, the
embedded pair, a fresh process), in cheap forms: fewer tokens, prompts, repeats and training steps.

The cluster commands (`dspine serve`, `status`, `deploy`, `serve --standalone`, `generate
--server`) run in tests/cluster/test_cli_serve.py and test_serve_deploy.py; `bench engine
--tracing / --trace-out / --verify-threshold / --json` in tests/cluster/test_cli.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspine import embedded
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.reference import reference_generate

DSPINE = Path(sys.executable).parent / "dspine"
PROMPT = "def fibonacci(n):"  # the quick start's
FLOAT = r"(\d+(?:\.\d+)?)"


def dspine(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    assert DSPINE.exists(), f"the `dspine` console script is not installed next to {sys.executable}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([str(DSPINE), *argv], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"dspine {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def _figure(pattern: str, text: str) -> tuple[str, ...]:
    match = re.search(pattern, text)
    assert match, f"no line matching {pattern!r} in:\n{text}"
    return match.groups()


@pytest.fixture(scope="module")
def engine():
    """The engine `dspine generate` builds by default: the embedded pair, EngineConfig defaults."""
    return Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, EngineConfig())


# ------------------------------------------------------------ dspine generate
def test_quick_start_generate_locally():
    proc = dspine("generate", "--prompt", PROMPT, "--max-new-tokens", "8")
    assert proc.stdout.startswith(PROMPT) and len(proc.stdout.strip()) > len(PROMPT)
    reason, spec, drafter, cycles, accepted, rate = _figure(
        rf"\[(\w+); speculative=(\w+), drafter=(\w*), cycles=(\d+), mean_accepted_len={FLOAT}, "
        rf"decode_tokens_per_s={FLOAT}\]", proc.stderr)
    assert (reason, spec, drafter) == ("length", "True", "greedy") and int(cycles) >= 1 and float(rate) > 0
    assert 0 <= float(accepted) <= 15


def test_generate_json_is_the_engine_greedy_output(engine):
    printed = json.loads(dspine("generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--json").stdout)
    assert set(printed) == {"text", "token_ids", "finish_reason", "speculative", "drafter", "cycles",
                            "mean_accepted_len", "decode_tokens_per_s"}
    assert printed["drafter"] == "greedy"  # temperature 0: the greedy drafter, also with the sampled one shipped
    assert printed["speculative"] is True and printed["finish_reason"] == "length" and printed["cycles"] >= 1
    prompt_ids = engine.encode(PROMPT)
    # lossless: the speculative CLI output is the target's own greedy continuation
    assert printed["token_ids"] == reference_generate(engine.target, prompt_ids, 8)
    assert printed["text"] == engine.decode(printed["token_ids"]) and printed["text"]


def test_generate_json_sampled_target_only_is_reproducible_from_its_seed(engine):
    flags = ["--no-spec", "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--seed", "3"]
    printed = json.loads(dspine("generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--json", *flags).stdout)
    assert printed["speculative"] is False and (printed["cycles"], printed["mean_accepted_len"]) == (0, 0.0)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3, max_new_tokens=8)
    expected = engine.generate_text(PROMPT, params, speculative=False)
    assert printed["token_ids"] == expected.token_ids and printed["text"] == expected.text


# --------------------------------------------------------------- dspine info
def test_info_prints_the_article_memory_figures():
    from dspine.replica.models.dspine_config import DraftArgs

    out = dspine("info", "--draft-preset", "dspine-27b-b16").stdout
    args = DraftArgs.from_name("dspine-27b-b16")
    # recomputed here from the preset (BF16 = 2 bytes): K and V of every drafter layer per position,
    # the [V, D] codebook, and the greedy tail tables [V, M] + [V, 2M]
    per_position = args.num_layers * 2 * args.kv_dim * 2
    assert (per_position, args.window) == (20_480, 8192)
    assert per_position * args.window == 160 * 2**20
    assert round(args.vocab_size * args.code_dim * 2 / 2**20) == 485
    assert args.vocab_size * 3 * args.message_dim * 2 / 2**20 == 727.5
    for line in (r"draft K/V per position\s+20,480 B", r"draft K/V, 8,192-position window\s+160 MiB",
                 r"token codebook \[V, D\]\s+485 MiB", r"greedy tail tables \[V, M\] \+ \[V, 2M\]\s+727\.5 MiB"):
        assert re.search(line, out), (line, out)


# -------------------------------------------------------------- dspine bench
def test_bench_target_prints_the_ratio_and_identical_tokens():
    pytest.importorskip("transformers")  # the baseline (a dev dependency)
    out = dspine("bench", "target", "--prompt-len", "8", "--new-tokens", "8", "--repeats", "1").stdout
    ours, = _figure(rf"dspine engine\s+{FLOAT} tok/s", out)
    theirs, = _figure(rf"transformers generate\s+{FLOAT} tok/s", out)
    ratio, identical = _figure(rf"ratio dspine / transformers: {FLOAT}x\s+identical tokens: (\w+)", out)
    assert float(ours) > 0 and float(theirs) > 0
    assert float(ratio) == pytest.approx(float(ours) / float(theirs), abs=0.006)  # printed to 2 decimals
    assert identical == "True"


def _bench_engine_figures(out: str) -> dict:
    figures = {}
    for name, pattern in {
        "target_only": rf"target-only\s+{FLOAT} tok/s\s+\((\d+) tokens",
        "speculative": rf"speculative\s+{FLOAT} tok/s\s+\((\d+) tokens",
        "speedup": rf"speedup\s+{FLOAT}x\s+\(median of (\d+) paired runs",
        "accepted": rf"mean accepted length {FLOAT} \(committed per cycle {FLOAT}; verified per cycle {FLOAT}\)",
        "histogram": r"accepted-length histogram \[([\d, ]+)\]",
        "bound": rf"-> bound {FLOAT}x",
    }.items():
        figures[name] = _figure(pattern, out)
    return figures


def test_bench_engine_prints_ratio_and_accepted_length(tmp_path):
    plot = tmp_path / "bench.png"
    out = dspine("bench", "engine", "--num-prompts", "1", "--prompt-len", "16", "--max-new-tokens", "8",
                 "--repeats", "1", "--plot", str(plot)).stdout
    assert f"wrote {plot}" in out
    png = plot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert int.from_bytes(png[16:20], "big") == 1100 and int.from_bytes(png[20:24], "big") == 420
    f = _bench_engine_figures(out)
    assert f["target_only"][1] == f["speculative"][1] == "8"
    target_only, speculative = float(f["target_only"][0]), float(f["speculative"][0])
    speedup, runs = f["speedup"]
    assert int(runs) == 1 and float(speedup) == pytest.approx(speculative / target_only, rel=0.02, abs=0.006)
    accepted, committed, verified = map(float, f["accepted"])
    assert committed == pytest.approx(accepted + 1, abs=0.006) and 0 <= accepted <= verified <= 15
    histogram = [int(x) for x in f["histogram"][0].split(",")]
    assert len(histogram) == 16 and sum(histogram) >= 1  # cycles by accepted length 0..15
    assert sum(i * n for i, n in enumerate(histogram)) / sum(histogram) == pytest.approx(accepted, abs=0.006)
    assert float(f["bound"][0]) > 0
    assert "greedy speculative output identical to target-only: True" in out


def test_bench_engine_sampled_and_batched_form():
    # the README's `--temperature 0.7 --seed 0` and `--concurrency 8` rows, cheaply
    out = dspine("bench", "engine", "--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "8",
                 "--repeats", "1", "--temperature", "0.7", "--seed", "0", "--concurrency", "2").stdout
    assert "2 prompts, concurrency 2, temperature 0.7" in out
    f = _bench_engine_figures(out)
    assert f["target_only"][1] == f["speculative"][1] == "16"
    assert float(f["speedup"][0]) > 0
    assert "identical to target-only" not in out  # sampled runs make no identity claim


# -------------------------------------------------------------- dspine train
@pytest.mark.slow
def test_train_target_then_draft_rebuilds_a_loadable_pair(tmp_path):
    """The README's rebuild commands on a 2-file corpus and 2 steps each (~25 s): the outputs load
    through the ordinary loaders and `dspine generate` decodes losslessly with them."""
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    done = dspine("train", "target", "--out", str(target_dir), "--steps", "2", "--max-files", "2", "--seq-len", "32",
                  "--batch-size", "2", timeout=300)
    out = done.stdout
    assert re.search(r"held-out perplexity \d", out), out
    # progress off a terminal: a plain line (no bar's carriage returns) with the count and elapsed time
    assert re.search(r"^train target: 2/2 steps \(100%\), elapsed \d", done.stderr, re.M), done.stderr
    assert "\r" not in done.stderr
    summary = json.loads((target_dir / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["parameters"] > 0
    done = dspine("train", "draft", "--target", str(target_dir), "--out", str(draft_dir), "--steps", "2",
                  "--max-files", "2", "--num-sequences", "8", "--threads", "1", timeout=300)
    out = done.stdout
    assert f"drafter saved to {draft_dir}" in out, out
    assert re.search(r"^train draft: 2/2 steps \(100%\), elapsed \d", done.stderr, re.M), done.stderr
    assert re.search(r"^train continuations: 8/8 sequences", done.stderr, re.M), done.stderr
    assert json.loads((draft_dir / "train_summary.json").read_text())["num_sequences"] == 8

    printed = json.loads(dspine("generate", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt", PROMPT,
                                "--max-new-tokens", "8", "--json").stdout)
    assert printed["speculative"] is True
    rebuilt = Engine.from_pretrained(target_dir, draft_dir, EngineConfig())
    expected = reference_generate(rebuilt.target, rebuilt.encode(PROMPT), 8)
    assert printed["token_ids"] == expected[:len(printed["token_ids"])] and printed["token_ids"]


@pytest.mark.timeout(120)
def test_the_library_use_snippet_runs_as_pasted():
    """The README's "Library use" block, executed verbatim in a fresh interpreter."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Library use"):]
    snippet = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 9)]
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=110,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().split()[-2] in ("length", "stop")  # text ... finish_reason mean_accepted_len
