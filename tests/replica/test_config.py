"""EngineConfig: defaults, derived dtypes and the errors that name the field."""

from __future__ import annotations

import pytest
import torch

from dspine.replica.config import EngineConfig


def test_cpu_defaults_and_derived_dtypes():
    config = EngineConfig(device="cpu")
    assert config.torch_dtype == torch.float32
    assert config.torch_draft_dtype == torch.float32  # "auto": the target's dtype
    assert EngineConfig(device="cpu", draft_dtype="bfloat16").torch_draft_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", dtype="bfloat16").torch_draft_dtype == torch.bfloat16
    assert 0.0 < config.verify_threshold < 1.0
    assert config.retrieval_mode in ("bf16", "exact")  # never fp8 off cuda
    assert EngineConfig(device="cpu", retrieval="exact").retrieval_mode == "exact"


@pytest.mark.parametrize("field,value", [
    ("max_concurrency", 0), ("draft_pool", "paged"), ("max_seq_len", 1), ("dtype", "fp8"),
    ("draft_dtype", "int8"), ("retrieval", "int4"), ("verify_threshold", -0.1), ("verify_threshold", 1.0),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**{field: value})
