"""Fixtures for engine tests: tiny random targets and drafters, built in milliseconds."""

from __future__ import annotations

import pytest

from dspine_testing.engines import make_engine  # engine tests import it from here too (.conftest)
from dspine_testing.models import make_target


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
