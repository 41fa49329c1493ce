"""The engine's drafters: the greedy one and, optionally, a sampled one, chosen per request.

The shipped drafter is distilled on the target's greedy continuations and accepts far less
under sampling; a second drafter distilled on sampled continuations (soft labels) serves the
sampled requests. Both have the same geometry (the same :class:`DraftArgs` but for the tail's
candidate counts), so they share the engine's ONE draft KV pool (its slots are per request, and
a request drafts with one drafter for its whole life) and one verify layout; each has its own
tail tables, with its own number of candidates per row (``head_topk``, K) and of retrieved
tokens they are rescored from (``num_retrieve``, R): a sampled request's target is spread over
more tokens than a greedy one's, and its drafter gains from more candidates.

Terms: a request's *drafter name* is :data:`GREEDY`, :data:`SAMPLED` or ``""`` (not
speculative). It is chosen once, at admission (:func:`choose_drafter`), stored on the request
and reported in its speculation stats. Which drafter proposes never changes what is emitted
(verification is lossless), only how much is accepted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dspine import faults

from .errors import DrafterGeometryError

GREEDY = "greedy"
SAMPLED = "sampled"


@dataclass(frozen=True)
class LoadedDrafter:
    """One drafter as the model runner uses it."""

    name: str  # GREEDY or SAMPLED
    model: object  # DSpineDrafter
    tail_tables: object  # its TailTables (built from its own bridge and codebook)


def check_drafter_pair(greedy_args, sampled_args) -> None:
    """A sampled drafter (``sampled_args`` not None) needs a greedy one of the same geometry."""
    if sampled_args is None:
        return
    if greedy_args is None:
        raise ValueError("sampled_draft_dir: a sampled drafter needs the greedy drafter (draft_dir) too")
    check_same_geometry(greedy_args, sampled_args)


# Fields of DraftArgs that only size a drafter's own tail (its candidates per row), not the draft
# KV pool, the drafter's forward or the verify layout: two drafters may differ in them.
PER_DRAFTER_FIELDS = frozenset({"head_topk", "num_retrieve"})


def check_same_geometry(greedy_args, sampled_args) -> None:
    """Raise :class:`DrafterGeometryError` naming the first DraftArgs field that differs
    (:data:`PER_DRAFTER_FIELDS` excepted)."""
    for f in dataclasses.fields(greedy_args):
        if not f.init or f.name in PER_DRAFTER_FIELDS:  # derived fields follow from the others
            continue
        greedy, sampled = getattr(greedy_args, f.name), getattr(sampled_args, f.name)
        if greedy != sampled:
            raise DrafterGeometryError(f.name, greedy, sampled)


def choose_drafter(temperature: float, speculative: bool, has_sampled: bool, min_temperature: float) -> str:
    """The drafter a request uses for its whole life: ``""`` when it does not speculate, the sampled
    drafter when one is loaded and ``temperature >= min_temperature``, else the greedy one."""
    if not speculative:
        return ""
    if faults.active("engine.drafter_choice_ignores_temperature"):
        return GREEDY
    return SAMPLED if has_sampled and temperature >= min_temperature else GREEDY


def describe_drafters(drafters: dict[str, LoadedDrafter], min_temperature: float) -> str:
    """One line for logs: which drafters are loaded and the threshold."""
    if not drafters:
        return "no drafter"
    if SAMPLED not in drafters:
        return "one drafter (greedy) for every request"
    return f"two drafters: sampled for temperature >= {min_temperature:g}, greedy below"
