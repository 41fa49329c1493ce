"""Whether freed slots are taken again soon (replica/slot_refills.py): measured by the scheduler,
read by the policy's drain pricing."""

from __future__ import annotations

import pytest

from dspine import faults
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.slot_refills import SlotRefills

pytestmark = pytest.mark.timeout(120)


def test_a_slot_taken_within_the_window_counts_as_refilled():
    refills = SlotRefills(within_steps=3, decay=0.5)
    refills.on_finish(num_still_running=4)
    refills.on_step()
    refills.on_add()
    assert refills.share == 1.0
    refills.on_finish(num_still_running=4)
    for _ in range(4):  # past the window: not refilled
        refills.on_step()
    assert refills.share == 0.5
    refills.on_add()  # no slot open: a request into a free slot says nothing
    assert refills.share == 0.5


def test_the_last_request_of_a_batch_judges_the_open_slots_unrefilled():
    """A closed group's next group arrives once the batch has drained: its requests do not count as
    refilling the slots the group's early finishers left."""
    refills = SlotRefills(within_steps=8, decay=0.5)
    refills.on_finish(num_still_running=2)
    refills.on_step()
    refills.on_finish(num_still_running=1)
    refills.on_step()
    refills.on_finish(num_still_running=0)
    for _ in range(4):
        refills.on_add()
    assert refills.share == 0.25


def test_a_batch_that_ends_in_one_step_reads_as_unrefilled():
    """Requests that all end at the same step, the next ones arriving after: a closed group (one
    that ran ahead would have had its replacement prefilled alone)."""
    refills = SlotRefills(within_steps=8, decay=0.5)
    refills.on_step()
    for still_running in (3, 2, 1, 0):
        refills.on_finish(num_still_running=still_running)
    for _ in range(4):
        refills.on_add()
    assert refills.share == 0.125


def _plan_shares(engine: Engine, closed: bool) -> list[float]:
    """The refill shares the policy was given, decoding 16 prompts of uneven lengths 4 at a time:
    as closed groups of 4 or as one load that refills freed slots."""
    shares = []
    policy = engine.scheduler.policy
    original = policy.plan

    def plan(candidates, num_target_only=0, sampled=frozenset(), **pricing):
        shares.append(pricing["refill_share"])
        return original(candidates, num_target_only, sampled, **pricing)

    policy.plan = plan
    prompts = [[3 + i, 1, 4, 1 + i % 3] for i in range(16)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=6 + 5 * (i % 4), ignore_eos=True) for i in range(16)]
    if closed:
        for start in range(0, 16, 4):
            engine.generate_many(prompts[start:start + 4], params[start:start + 4], speculative=True)
    else:
        engine.generate_many(prompts, params, speculative=True, max_in_flight=4)
    return shares


def _engine(target) -> Engine:
    from dspine.replica.models.dspine_checkpoint import init_random_drafter
    from dspine.replica.models.dspine_config import DraftArgs

    drafter = init_random_drafter(target, DraftArgs.for_target(target.args, num_retrieve=32), seed=0).eval()
    return Engine(target, drafter, None, EngineConfig(device="cpu", dtype="float32", adaptive_speculation=True,
                                                      max_concurrency=4))


def test_a_closed_group_reads_as_unrefilled(dense_target):
    """Closed groups of 4 leave their early finishers' slots empty: the policy sees the share fall
    to about a quarter by the last group (3 of every 4 frees unrefilled); a load that refills its
    slots keeps it above."""
    closed = _plan_shares(_engine(dense_target), closed=True)
    refilled = _plan_shares(_engine(dense_target), closed=False)
    assert closed[-1] < 0.4 and refilled[len(refilled) // 2] > 0.9
    with faults.inject("scheduler.refills_unmeasured"):
        assert set(_plan_shares(_engine(dense_target), closed=True)) == {1.0}

