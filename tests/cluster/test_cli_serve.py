"""`dspine serve --standalone` in a subprocess, driven by `dspine generate --server`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from dspine.cluster.cli import main
from dspine.cluster.client import DSpineClient
from dspine.replica.models.loader import save_target

from .conftest import make_target


def test_serve_standalone_and_generate_via_server(tmp_path, tokenizer_dir, capsys):
    target_dir = tmp_path / "tiny-target"
    save_target(make_target(), target_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, target_dir / name)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dspine.cluster.cli", "serve", "--standalone", "--target", str(target_dir),
               "--port", "0", "--device", "cpu", "--dtype", "float32", "--max-concurrency", "2", "--max-seq-len", "64"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            line = proc.stdout.readline()
            assert "serving on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
            address = line.strip().rsplit(" ", 1)[-1]
            with DSpineClient(address, timeout=60) as client:
                info = client.info()
                assert (info.target_name, info.max_concurrency, info.max_context, info.has_drafter) == (
                    "tiny-target", 2, 64, False)
                expected = client.generate("def f():", max_new_tokens=3)
            capsys.readouterr()
            assert main(["generate", "--server", address, "--prompt", "def f():", "--max-new-tokens", "3",
                         "--no-spec", "--json"]) == 0
            printed = json.loads(capsys.readouterr().out)
            assert printed["token_ids"] == expected.token_ids and printed["finish_reason"] == expected.finish_reason
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, proc.stderr.read()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dspine_serve_starts_the_cluster_and_status_reads_it(tmp_path):
    from dspine_testing.ray_cluster import free_port

    grpc_port, http_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dspine.cluster.cli", "serve", "--replicas", "2", "--port", str(grpc_port),
               "--http-port", str(http_port), "--max-queued", "4"]
    # stderr to a file (a pipe nobody reads could fill and stall Ray's start), shown if the start fails
    stderr_path = tmp_path / "serve.stderr"
    with stderr_path.open("w") as stderr, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                                           env=env) as proc:
        try:
            line = proc.stdout.readline()
            assert f"cluster serving dspine.v1 on 127.0.0.1:{grpc_port}" in line, (
                line, stderr_path.read_text()[-3000:])
            hint = proc.stdout.readline()
            assert f"dspine generate --server 127.0.0.1:{grpc_port}" in hint, hint
            with DSpineClient(f"127.0.0.1:{grpc_port}", timeout=60) as client:
                info = client.info()
                assert (info.max_concurrency, info.has_drafter) == (8, True)
                assert len(client.generate("def f():", max_new_tokens=6).token_ids) == 6
            status = subprocess.run([sys.executable, "-m", "dspine.cluster.cli", "status", "--json"],
                                    capture_output=True, text=True, timeout=120, env=env)
            assert status.returncode == 0, status.stderr[-2000:]
            report = json.loads(status.stdout)
            assert report["status"] == "RUNNING" and len(report["replicas"]) == 2
            assert all(r["healthy"] and r["max_concurrency"] == 8 for r in report["replicas"])
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0, stderr_path.read_text()[-3000:]


@pytest.mark.timeout(180)
def test_generate_prints_the_same_figures_and_errors_locally_and_through_a_server(capsys):
    """`--json` through `--server` carries the speculation and throughput figures a local run
    prints, and a bad request reads the same (status, field, words; exit 1) either way."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dspine.cluster.cli", "serve", "--standalone", "--port", "0", "--device", "cpu",
               "--dtype", "float32", "--max-concurrency", "2"]
    args = ["--prompt", "def fibonacci(n):", "--max-new-tokens", "12", "--json"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            line = proc.stdout.readline()
            assert "serving on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
            address = line.strip().rsplit(" ", 1)[-1]
            capsys.readouterr()
            assert main(["generate", "--server", address, *args]) == 0
            served = json.loads(capsys.readouterr().out)
            assert main(["generate", "--server", address, "--prompt", "", "--max-new-tokens", "2"]) == 1
            served_error = capsys.readouterr().err.strip()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, proc.stderr.read()
    assert main(["generate", *args, "--device", "cpu", "--dtype", "float32"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(["generate", "--prompt", "", "--max-new-tokens", "2"]) == 1
    local_error = capsys.readouterr().err.strip()

    assert set(served) == set(local)
    assert served["token_ids"] == local["token_ids"]  # greedy: the same tokens, speculation on both sides
    assert served["speculative"] is True and served["cycles"] > 0 and served["decode_tokens_per_s"] > 0
    assert served["mean_accepted_len"] >= 0
    assert served_error == local_error == "dspine generate: error: INVALID_ARGUMENT: text: must not be empty"
