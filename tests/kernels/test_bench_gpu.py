"""The GPU check script must not rot: its --cpu-smoke mode runs every kernel tiny, under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def test_bench_gpu_cpu_smoke():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "dspine.kernels.bench_gpu", "--cpu-smoke"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for name in ("fp8_head_topk", "tail_tables", "tail_chain"):
        rows = [ln for ln in lines if ln.startswith(name + " ")]
        assert len(rows) == 2 and all(ln.rstrip().split("  ")[-1].startswith("OK") for ln in rows), res.stdout
    assert "all kernels match their references" in res.stdout


def test_bench_gpu_without_cuda_exits_cleanly():
    if torch.cuda.is_available():
        return
    res = subprocess.run([sys.executable, "-m", "dspine.kernels.bench_gpu"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "no CUDA device" in res.stdout
