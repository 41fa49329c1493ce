"""Fixtures for the bench tests: the engine tests' tiny random models (built in milliseconds)."""

from __future__ import annotations

import pytest
from dspine_testing.models import make_target


@pytest.fixture
def hybrid_target():
    return make_target("tiny")
