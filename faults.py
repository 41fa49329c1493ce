"""Named fault points: deliberate bugs that tests switch on to prove their own power.

A test that still passes with the code it guards removed proves nothing. Each
entry of :data:`FAULTS` names one real way to break lossless speculative
decoding, and the code it breaks checks :func:`active` at exactly that spot;
the statistical tests then run once normally (they must pass) and once under
:func:`inject` (they must fail). Nothing is active unless a test injects it,
and a check costs one set lookup.

Faults are process-wide (the engine's device thread sees them) and must only
be injected by tests.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["FAULTS", "active", "inject"]

FAULTS: dict[str, str] = {
    "tail.q_from_wrong_row": "the tail's q (and confidence) read the table row of the token's own slot "
                             "instead of its predecessor's (predecessor_slots returns the choice)",
    "tail.confidence_reads_own_draw": "dynamic verification's confidence of row t is q_t(y_t), the "
                                      "probability of the token drawn at that row",
    "verify.always_accept": "sampled verification accepts every draft token",
    "verify.recover_from_p": "the token after a rejection is drawn from p instead of the residual [p - q]+",
    "verify.bonus_from_residual": "after a truncated verify (num_draft < K) accepted in full, the bonus is "
                                  "drawn from the residual [p - q]+ of the next row instead of from p",
    "runner.p_without_temperature": "the target's p used by verification ignores the request's temperature",
    "runner.p_without_top_p": "the target's p used by verification ignores the request's top-p",
    "paged_kv.write_padded_rows": "a ragged paged step writes every padded row of the batch into the "
                                  "target K/V pool, not only the requests' new rows",
    "paged_kv.slot_off_by_one": "the paged step stores each new K/V row one slot past its position",
    "paged_kv.free_keeps_blocks": "freeing a request (finish, cancel, failure) does not return its target "
                                  "K/V blocks to the pool",
}

_active: frozenset[str] = frozenset()


def active(name: str) -> bool:
    """True while a test has injected ``name``."""
    return name in _active


@contextmanager
def inject(*names: str) -> Iterator[None]:
    """Switch the named faults on for the duration of the block (tests only)."""
    global _active
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"names: unknown fault(s) {unknown}; known: {sorted(FAULTS)}")
    before = _active
    _active = before | frozenset(names)
    try:
        yield
    finally:
        _active = before
