"""Fixtures for engine tests: tiny random targets and drafters, built in milliseconds."""

from __future__ import annotations

import pytest
import torch

from dspine.replica import Engine, EngineConfig
from dspine.replica.models.dspine_checkpoint import init_random_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.target import TargetModel
from dspine.replica.models.target_config import TargetArgs


def make_target(preset: str = "tiny", seed: int = 0, **overrides) -> TargetModel:
    torch.manual_seed(seed)
    args = TargetArgs(**{**_preset_fields(preset), **overrides})
    model = TargetModel(args)
    with torch.no_grad():
        # Larger-than-default logits so greedy choices are not near-ties.
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "conv1d" not in name:
                param.normal_(0.0, 0.08)
    return model.eval()


def _preset_fields(preset: str) -> dict:
    from dspine.replica.models.target_config import TARGET_CONFIGS

    return dict(TARGET_CONFIGS[preset])


def make_engine(target: TargetModel, window: int = 8, seed: int = 0, with_drafter: bool = True,
                **config) -> Engine:
    drafter = None
    if with_drafter:
        args = DraftArgs.for_target(target.args, window=window, num_retrieve=min(32, target.args.vocab_size))
        drafter = init_random_drafter(target, args, seed=seed).eval()
    config.setdefault("device", "cpu")
    config.setdefault("dtype", "float32")
    return Engine(target, drafter, None, EngineConfig(**config))


@pytest.fixture
def hybrid_target():
    return make_target("tiny")


@pytest.fixture
def dense_target():
    return make_target("tiny-qwen3")


@pytest.fixture
def build():
    """Factories for tests that parametrize the model: ``build.target(preset)``, ``build.engine(target)``."""
    from types import SimpleNamespace

    return SimpleNamespace(target=make_target, engine=make_engine)
