"""``python -m dspine.benchmarks.acceptance``: Gumbel (reproducible) vs rejection sampling on the same requests."""

from __future__ import annotations

import pytest
import torch
from dspine_testing.distill import distilled_pair

from dspine.benchmarks.acceptance import measure
from dspine.replica import Engine, EngineConfig


def test_acceptance_bench_runs_both_modes_on_the_same_requests():
    target, drafter = distilled_pair()
    engine = Engine(target, drafter, None, EngineConfig(device="cpu", dtype="float32", retrieval="exact",
                                                        adaptive_speculation=False))
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (2, 6)]
    report = measure(engine, prompts, seeds=3, temperature=0.7, top_p=1.0, max_new_tokens=12)
    assert report["rejection"]["cycles"] > 0 and report["gumbel"]["cycles"] > 0
    assert report["ratio_gumbel_over_rejection"] == pytest.approx(
        report["gumbel"]["accepted_per_cycle"] / report["rejection"]["accepted_per_cycle"], abs=1e-3)
