"""Progress of long work (training, benches): a bar on a terminal, plain lines elsewhere.

On a terminal this is tqdm's bar (count, elapsed, ETA, rate, and whatever the
loop reports, e.g. the loss). When the stream is not a terminal (CI logs, a file,
``nohup``), a bar's carriage returns would fill the log with partial lines, so it
writes one plain line every ``interval_s`` seconds and at the end instead::

    train target: 120/750 steps (16%), elapsed 1m02s, ETA 5m27s, loss 4.123
"""

from __future__ import annotations

import sys
import time
from typing import IO

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``75.3`` -> ``'1m15s'``; ``3725`` -> ``'1h02m05s'``; under a minute: ``'9.4s'``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """``with Progress(total, "train target", unit="steps") as bar: ... bar.update(1, loss=...)``."""

    def __init__(self, total: int, desc: str, unit: str = "steps", stream: IO[str] | None = None,
                 interval_s: float = 30.0, clock=time.monotonic):
        self.total = max(0, int(total))
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.clock = clock
        self.count = 0
        self.postfix: dict[str, object] = {}
        self._start = clock()
        self._last_line = self._start
        self._bar = None
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=f" {unit}", file=self.stream, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix) -> None:
        """``n`` more units done; ``postfix`` (e.g. ``loss=3.2``) is shown beside the count."""
        self.count += n
        self.postfix.update(postfix)
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix({k: _short(v) for k, v in self.postfix.items()}, refresh=False)
            self._bar.update(n)
            return
        now = self.clock()
        if now - self._last_line >= self.interval_s or self.count >= self.total:
            self._last_line = now
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        """The plain progress line at ``now``."""
        elapsed = (self.clock() if now is None else now) - self._start
        parts = [f"{self.desc}: {self.count}/{self.total} {self.unit}"
                 + (f" ({100 * self.count / self.total:.0f}%)" if self.total else "")]
        parts.append(f"elapsed {format_seconds(elapsed)}")
        if 0 < self.count < self.total:
            parts.append(f"ETA {format_seconds(elapsed / self.count * (self.total - self.count))}")
        parts += [f"{k} {_short(v)}" for k, v in self.postfix.items()]
        return ", ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
