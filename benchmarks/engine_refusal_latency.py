"""How long a full engine takes to refuse while its background loop steps (issue 20, item 7).

The embedded pair, 8 slots filled with long requests, the loop stepping; 8 threads then send
200 requests that must be refused (EngineFullError). Measured twice in the same run: with the
engine's locking, and with the fault ``engine.admission_waits_for_step`` (the old locking, where
admission waits for the lock the step holds while the model runs). Prints median, p95 and max
latency of each and the ratio of the maxima.

    python -m dspine.benchmarks.engine_refusal_latency [--attempts 200] [--threads 8]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def measure(engine, prompt, params, attempts: int, threads: int) -> list[float]:
    """Seconds each refused ``add_request`` took, sorted."""
    from dspine.replica import EngineFullError

    latencies: list[float] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for _ in range(n):
            start = time.perf_counter()
            try:
                engine.add_request(prompt, params)
                raise RuntimeError("a full engine admitted a request")
            except EngineFullError:
                pass
            with lock:
                latencies.append(time.perf_counter() - start)
            time.sleep(0.002)

    workers = [threading.Thread(target=worker, args=(attempts // threads,)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=200)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()

    from dspine import faults
    from dspine.embedded import DRAFT_DIR, TARGET_DIR
    from dspine.replica import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(TARGET_DIR, DRAFT_DIR, EngineConfig(max_concurrency=8, device="cpu"))
    params = SamplingParams(temperature=0.0, max_new_tokens=100_000, ignore_eos=True)
    prompt = engine.encode("import os\nimport sys\n" * 4)
    engine.start()
    try:
        for _ in range(engine.config.max_concurrency):
            engine.add_request(prompt, params)
        while engine.stats.num_steps < 2:  # the loop is decoding
            time.sleep(0.05)
        maxima = {}
        for name, fault in (("engine locking", None), ("old locking (fault)", "engine.admission_waits_for_step")):
            with faults.inject(*([fault] if fault else [])):
                lat = measure(engine, prompt, params, args.attempts, args.threads)
            maxima[name] = lat[-1]
            print(f"{name:20s} n={len(lat)} median={statistics.median(lat) * 1e3:.3f} ms "
                  f"p95={lat[int(0.95 * len(lat))] * 1e3:.3f} ms max={lat[-1] * 1e3:.3f} ms")
        steps = max(engine.stats.num_steps, 1)
        print(f"engine steps: {engine.stats.num_steps}, mean verify stage {engine.stats.stage_times.verify / steps * 1e3:.1f} ms")
        print(f"max refusal latency, old / new: {maxima['old locking (fault)'] / maxima['engine locking']:.0f}x")
    finally:
        engine.shutdown(drain=False, timeout=60)


if __name__ == "__main__":
    main()
