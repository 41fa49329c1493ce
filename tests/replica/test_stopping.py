"""Stop rules and what a streaming caller is allowed to see."""

from __future__ import annotations

import pytest

from dspine.replica.sampling import SamplingParams
from dspine.replica.stopping import StopChecker
from dspine.replica.types import RequestStatus

# A toy tokenizer: token i decodes to PIECES[i].
PIECES = ["a", "b", "c", "\n", "\n\n", "END", "x", "EN", "D"]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def checker(**params):
    params.setdefault("max_new_tokens", 100)
    return StopChecker(SamplingParams(**params), prompt_len=3, max_context=1000, eos_token_ids=(5,), decode=decode)


def test_eos_stops_and_is_not_part_of_the_output():
    c = checker()
    release = c.extend([0, 1, 5, 2])
    assert release.status == RequestStatus.FINISHED_STOPPED
    assert c.output_ids == [0, 1] and release.text == "ab"


def test_ignore_eos_and_stop_token_ids():
    c = checker(ignore_eos=True, stop_token_ids=(6,))
    assert c.extend([5, 0]).status is None
    release = c.extend([1, 6, 2])
    assert release.status == RequestStatus.FINISHED_STOPPED and c.output_ids == [5, 0, 1]


def test_max_new_tokens_cuts_a_multi_token_commit():
    c = checker(max_new_tokens=3)
    release = c.extend([0, 1, 2, 0, 1])
    assert release.status == RequestStatus.FINISHED_LENGTH
    assert release.token_ids == [0, 1, 2]


def test_context_limit():
    c = StopChecker(SamplingParams(max_new_tokens=100), prompt_len=8, max_context=10, eos_token_ids=(), decode=decode)
    assert c.extend([0, 1, 2]).status == RequestStatus.FINISHED_LENGTH
    assert c.output_ids == [0, 1]


def test_stop_string_across_tokens_never_leaks():
    c = checker(stop=("END",))
    first = c.extend([0, 7])  # "aEN": "EN" may become "END", hold it back
    assert first.text == "a" and first.token_ids == [0] and first.status is None
    second = c.extend([8, 1])  # "aEND b"
    assert second.status == RequestStatus.FINISHED_STOPPED
    assert c.released_text == "a" and second.text == ""
    assert c.output_ids == [0]


def test_held_back_text_is_released_when_it_cannot_become_a_stop():
    c = checker(stop=("END",))
    assert c.extend([0, 7]).text == "a"
    release = c.extend([6])  # "aENx": no longer a prefix of END
    assert release.text == "ENx" and release.token_ids == [7, 6]


def test_stop_string_inside_one_token_cuts_the_text():
    c = checker(stop=("\n",))
    release = c.extend([0, 4, 1])
    assert release.status == RequestStatus.FINISHED_STOPPED
    assert c.released_text == "a"


@pytest.mark.parametrize("pieces", [[0, 1, 2, 0], [6, 6, 1]])
def test_without_stop_strings_everything_is_released_at_once(pieces):
    c = checker()
    release = c.extend(pieces)
    assert release.token_ids == pieces and release.text == decode(pieces)


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="stop"):
        StopChecker(SamplingParams(stop=("x",)), 1, 10, (), decode=None)
