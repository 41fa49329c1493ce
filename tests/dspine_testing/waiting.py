"""Polling with a deadline: a condition that never comes fails the test instead of hanging it."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float = 20.0, what: str = "condition", interval: float = 0.01):
    """Return ``predicate()``'s first truthy value; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
