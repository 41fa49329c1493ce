"""Progress of long work: plain lines off a terminal (paced, with ETA), tqdm's bar on one."""

from __future__ import annotations

import io

from dspine.progress import Progress, format_seconds


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_it_writes_paced_plain_lines_with_eta():
    clock, stream = FakeClock(), io.StringIO()
    progress = Progress(10, "train draft", unit="steps", stream=stream, interval_s=30.0, clock=clock)
    for step in range(10):
        clock.now += 10.0  # 10 s per step
        progress.update(1, loss=2.0 - 0.1 * step)
    lines = stream.getvalue().splitlines()
    # one line per 30 s and the last one, never a carriage return
    assert "\r" not in stream.getvalue()
    assert lines == [
        "train draft: 3/10 steps (30%), elapsed 30.0s, ETA 1m10s, loss 1.8",
        "train draft: 6/10 steps (60%), elapsed 1m00s, ETA 40.0s, loss 1.5",
        "train draft: 9/10 steps (90%), elapsed 1m30s, ETA 10.0s, loss 1.2",
        "train draft: 10/10 steps (100%), elapsed 1m40s, loss 1.1",
    ]


def test_on_a_terminal_it_draws_a_bar():
    stream = Terminal()
    with Progress(4, "bench engine", unit="groups", stream=stream) as progress:
        for _ in range(4):
            progress.update(1, loss=0.5)
    text = stream.getvalue()
    assert "\r" in text and "bench engine" in text and "4/4" in text and "loss=0.5" in text


def test_format_seconds():
    assert format_seconds(9.44) == "9.4s"
    assert format_seconds(75.3) == "1m15s"
    assert format_seconds(3725) == "1h02m05s"
