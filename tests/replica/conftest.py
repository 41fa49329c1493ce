"""Fixtures for engine tests: tiny random targets and drafters, built in milliseconds."""

from __future__ import annotations

import pytest

from dspine.replica import Engine, EngineConfig
from dspine.replica.models.dspine_checkpoint import init_random_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.target import TargetModel
from dspine_testing.models import make_target


def make_engine(target: TargetModel, window: int = 8, seed: int = 0, with_drafter: bool = True,
                **config) -> Engine:
    drafter = None
    if with_drafter:
        args = DraftArgs.for_target(target.args, window=window, num_retrieve=min(32, target.args.vocab_size))
        drafter = init_random_drafter(target, args, seed=seed).eval()
    # The random drafter almost never gets a row right, so adaptive speculation would soon stop
    # drafting; tests of the verification path need every step to speculate. Policy tests and the
    # distilled-drafter equivalence tests run with it on.
    config.setdefault("adaptive_speculation", False)
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
