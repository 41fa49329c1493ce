"""The fault points tests use to prove their own power are off unless injected, and only known ones exist."""

import threading

import pytest

from dspine import faults


def test_nothing_is_active_by_default():
    assert not any(faults.active(name) for name in faults.FAULTS)


def test_inject_switches_on_for_the_block_only_and_every_thread_sees_it():
    seen = []
    with faults.inject("verify.always_accept"):
        assert faults.active("verify.always_accept")
        assert not faults.active("verify.recover_from_p")
        thread = threading.Thread(target=lambda: seen.append(faults.active("verify.always_accept")))
        thread.start()
        thread.join(timeout=10)
    assert seen == [True]  # the engine steps on its own device thread
    assert not faults.active("verify.always_accept")


def test_inject_restores_after_an_exception():
    with pytest.raises(RuntimeError):
        with faults.inject("runner.p_without_top_p"):
            raise RuntimeError("boom")
    assert not faults.active("runner.p_without_top_p")


def test_unknown_fault_names_are_refused():
    with pytest.raises(ValueError, match="unknown fault"):
        with faults.inject("verify.alwys_accept"):
            pass
