"""`bench engine --tracing` measures span recording without taking the process's tracer provider."""

import subprocess
import sys

_SCRIPT = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from dspine.benchmarks.tracing_overhead import bench_tracing_overhead
from dspine.cluster import tracing
from dspine.embedded import DRAFT_DIR, TARGET_DIR
from dspine.replica import Engine, EngineConfig, SamplingParams

engine = Engine.from_pretrained(TARGET_DIR, DRAFT_DIR, EngineConfig(device="cpu", dtype="float32"))
report = bench_tracing_overhead(engine, [[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True), repeats=1)
assert report["pairs"] == 1 and report["tracing_on_vs_off_median"] > 0, report
# A server or test later in this process can still install its own provider (OpenTelemetry
# allows that once per process): the bench must not have spent it.
assert not tracing.enabled()
mine = TracerProvider()
trace.set_tracer_provider(mine)
assert trace.get_tracer_provider() is mine
print("ok")
"""


def test_the_bench_leaves_the_global_tracer_provider_unset():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
