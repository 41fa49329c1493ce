"""Encoding a long text does not stop the other threads (the server's event loop, the engine's thread).

`tokenizers` holds the GIL through a plain ``encode`` call (about a second for the 1,000,000
characters a request may carry) and releases it only in the batch calls; ``Tokenizer.encode``
uses those. The test counts how often the main thread runs while another thread encodes: with
the GIL held it runs at most a few times (before and after the call), not hundreds.
"""

from __future__ import annotations

import threading
import time

import pytest

from dspine import embedded, faults
from dspine.replica.tokenizer import Tokenizer

TEXT = ("def wrap(text, width):\n    return [text[i:i + width] for i in range(0, len(text), width)]\n" * 4000)


def _main_thread_turns_during_an_encode(tokenizer: Tokenizer) -> tuple[int, list[int]]:
    started, done = threading.Event(), threading.Event()
    result: list[list[int]] = []

    def encode():
        started.set()
        result.append(tokenizer.encode(TEXT))
        done.set()

    thread = threading.Thread(target=encode)
    thread.start()
    started.wait(10)
    turns = 0
    while not done.is_set():
        time.sleep(0)  # gives the GIL up; runs again as soon as it gets the GIL back
        turns += 1
    thread.join(30)
    return turns, result[0]


@pytest.fixture(scope="module")
def tokenizer():
    if not embedded.available():
        pytest.skip("the embedded pair is not in this installation")
    return Tokenizer.from_dir(embedded.TARGET_DIR)


@pytest.mark.parametrize("fault", [None, "tokenizer.encode_holds_gil"], ids=["batch-call", "plain-encode"])
def test_encoding_a_long_text_lets_other_threads_run(tokenizer, fault):
    with faults.inject(*([fault] if fault else [])):
        turns, ids = _main_thread_turns_during_an_encode(tokenizer)
    assert ids == tokenizer.tokenizer.encode(TEXT).ids  # the same ids either way
    if fault is None:
        assert turns > 100, turns
    else:
        assert turns < 20, turns  # the bug this guards against: the GIL held through the call


@pytest.mark.parametrize("text", ["def f(x):\n    return x  # ünïcode", TEXT], ids=["short", "long"])
def test_encode_and_decode_match_the_plain_calls(tokenizer, text):
    raw = tokenizer.tokenizer
    ids = tokenizer.encode(text)
    assert ids == raw.encode(text).ids
    assert tokenizer.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == raw.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == raw.decode(ids, skip_special_tokens=True)
