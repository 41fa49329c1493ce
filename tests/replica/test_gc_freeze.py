"""Programs that load an engine move its objects out of the collector's generations."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

# Loads the embedded pair, freezes, and reports what a full collection would walk before and after.
_PROGRAM = r"""
import gc, json, sys
from dspine import embedded, faults
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.gc_freeze import freeze_after_load

engine = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, EngineConfig(max_concurrency=2))
gc.collect()
before = len(gc.get_objects())
with faults.inject(*sys.argv[1:]):
    frozen = freeze_after_load()
after = len(gc.get_objects())
result = engine.generate(engine.tokenizer.encode("The"), SamplingParams(max_new_tokens=4))
print(json.dumps({"before": before, "after": after, "frozen": frozen, "tokens": len(result.token_ids)}))
"""


def _run(*fault_names: str) -> tuple[dict, str]:
    env = {**os.environ, "DSPINE_GC_FREEZE": "1"}
    done = subprocess.run([sys.executable, "-c", _PROGRAM, *fault_names], capture_output=True, text=True,
                          timeout=110, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_loaded_engine_is_frozen_and_still_decodes_and_exits_quietly():
    """After loading, a full collection walks a few objects, not the 100,000s the engine and its
    libraries hold; the engine decodes as before; at exit the frozen objects are handed back, so
    the bindings that check for leaks at shutdown (triton's) print nothing."""
    report, stderr = _run()
    assert report["before"] > 50_000 and report["after"] < 0.05 * report["before"], report
    assert report["frozen"] >= 0.9 * report["before"] and report["tokens"] == 4, report
    assert "leaked" not in stderr, stderr[-2000:]


def test_the_check_fails_when_nothing_is_frozen():
    report, _ = _run("gc.not_frozen")
    assert report["after"] > 0.5 * report["before"], report
