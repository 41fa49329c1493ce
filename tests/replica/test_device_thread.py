"""Every parallel torch op of an engine runs on its one device thread (the serving-path speed fix)."""

from __future__ import annotations

import threading

import pytest
import torch

from dspine import embedded
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.device_thread import DeviceThread


def test_call_runs_on_the_device_thread_and_passes_errors_back():
    device = DeviceThread(num_threads=1)
    assert device.call(lambda: threading.current_thread().name) == "dspine-device"
    assert device.call(torch.get_num_threads) == 1
    with pytest.raises(ZeroDivisionError):
        device.call(lambda: 1 / 0)
    assert device.call(lambda: device.call(lambda: 7)) == 7  # re-entrant: no deadlock
    device.close()


def _record_threads(engine: Engine) -> set[str]:
    seen: set[str] = set()
    execute = engine.runner.execute  # every model forward of a step runs inside it

    def spy(*args, **kwargs):
        seen.add(threading.current_thread().name)
        return execute(*args, **kwargs)

    engine.runner.execute = spy
    return seen


@pytest.mark.parametrize("background_loop", [False, True], ids=["inline", "loop"])
def test_engine_loads_and_steps_on_one_thread(background_loop):
    # The bug this guards: building the model on the caller's thread and stepping on the loop
    # thread (or the reverse) halved the serving path's speed with OpenMP torch builds.
    engine = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR,
                                    EngineConfig(device="cpu", dtype="float32", num_threads=1))
    loader_thread = engine._device_thread._thread.name
    seen = _record_threads(engine)
    if background_loop:
        engine.start()
    result = engine.generate(engine.encode("import os\n"), SamplingParams(max_new_tokens=12))
    engine.shutdown(drain=False, timeout=10)
    assert len(result.token_ids) == 12
    assert seen == {loader_thread}, seen
    assert threading.current_thread().name not in seen


def test_check_health_reports_a_dead_loop_and_a_stall(monkeypatch):
    engine = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, EngineConfig(device="cpu", dtype="float32"))
    engine.start()
    engine.check_health()
    gate = threading.Event()
    real_step = engine._step
    monkeypatch.setattr(engine, "_step", lambda: (gate.wait(30), real_step())[1])
    request_id = engine.add_request(engine.encode("x = "), SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="stalled"):
        for _ in range(100):
            engine.check_health(stall_s=0.05)
            threading.Event().wait(0.02)
    gate.set()
    engine.cancel(request_id)
    engine.shutdown(drain=False, timeout=10)
    assert engine.load().in_flight == 0
    engine._device_thread.close()
    engine._device_thread._thread.join(5)
    with pytest.raises(RuntimeError, match="device thread"):
        engine.check_health()


def test_peak_in_flight_is_the_high_water_mark():
    engine = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR,
                                    EngineConfig(device="cpu", dtype="float32", max_concurrency=3))
    ids = [engine.add_request(engine.encode(f"a{i} = "), SamplingParams(max_new_tokens=2)) for i in range(3)]
    assert engine.load().peak_in_flight == 3 and engine.load().free_slots == 0
    for request_id in ids:
        engine.cancel(request_id)
    load = engine.load()
    assert (load.in_flight, load.peak_in_flight, load.free_slots) == (0, 3, 3)
