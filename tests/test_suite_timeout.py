"""A hung test fails the suite instead of stalling it: pyproject sets a per-test deadline and
pytest-timeout, run with the repository's own pytest configuration, enforces it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _pytest_config() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]


def test_pyproject_sets_a_per_test_timeout(pytestconfig):
    timeout = _pytest_config()["timeout"]
    assert isinstance(timeout, int) and 0 < timeout <= 900  # per test; the whole suite has 25 minutes
    dev = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["dev"]
    assert any(d.replace(" ", "").startswith("pytest-timeout") for d in dev)
    # the suite now running has the plugin and reads that value (unless a run overrides it with -o)
    assert pytestconfig.pluginmanager.has_plugin("timeout")
    if not any(o.startswith("timeout=") for o in pytestconfig.option.override_ini or ()):
        assert float(pytestconfig.getini("timeout")) == timeout


def test_a_hanging_test_fails_with_a_timeout_and_its_stack(tmp_path):
    hang = tmp_path / "test_hang.py"
    hang.write_text("import time\n\n\ndef test_hangs_forever():\n    while True:\n        time.sleep(3600)\n")
    # The repository's configuration (-c: its addopts, its plugins), only the deadline shortened.
    command = [sys.executable, "-m", "pytest", "-c", str(PYPROJECT), "--rootdir", str(tmp_path),
               "-o", "timeout=2", "-q", str(hang)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_TIMEOUT", "PYTEST_ADDOPTS")}
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # 1: tests failed (not 0, not a usage or internal error)
    assert elapsed < 30, f"took {elapsed:.0f}s"
    assert "Timeout" in out and "1 failed" in out, out
    assert "time.sleep(3600)" in out and "test_hang.py" in out, out  # where it hung
