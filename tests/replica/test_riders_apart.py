"""A step whose plan runs its riders apart: the drafting requests verify in a forward of their own
rows, the others decode in a target-only forward after it, and the text is the same."""

from __future__ import annotations

import pytest

from dspine import faults
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.reference import reference_generate
from dspine.replica.speculation_policy import _PADDING_ROW_SHARE, StepPlan

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 9, 2, 7, 1, 3], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
NEW_TOKENS = 20


def _engine(target) -> Engine:
    from dspine.replica.models.dspine_checkpoint import init_random_drafter
    from dspine.replica.models.dspine_config import DraftArgs

    args = DraftArgs.for_target(target.args, window=64, num_retrieve=32)
    drafter = init_random_drafter(target, args, seed=0).eval()
    return Engine(target, drafter, None, EngineConfig(device="cpu", dtype="float32", adaptive_speculation=True,
                                                      verify_threshold=0.0))


def _run(target):
    """Three requests; on decode step i the first (by id) drafts 1 + i % 6 rows and the others ride
    (odd steps) or run apart (even steps). Returns the plans and, per decode step, the batch sizes
    of its target forwards and what the scheduler fed the cost model."""
    engine = _engine(target)
    plans: list[StepPlan] = []

    def plan(candidates, num_target_only=0, sampled=frozenset(), **pricing):
        first = sorted(candidates)[0]
        rows = {first: min(1 + len(plans) % 6, candidates[first])} if candidates[first] > 0 else {}
        plans.append(StepPlan(rows, riders_apart=bool(rows) and len(plans) % 2 == 0))
        return plans[-1]

    policy = engine.scheduler.policy
    policy.plan = plan
    forwards: list[int] = []
    original_forward = engine.runner.target.forward_step

    def forward_step(input_ids, states, *args, **kwargs):
        forwards.append(len(states))
        return original_forward(input_ids, states, *args, **kwargs)

    engine.runner.target.forward_step = forward_step
    observed: list[tuple] = []
    original_speculative, original_target = policy.costs.observe_speculative, policy.costs.observe_target_step
    policy.costs.observe_speculative = lambda drafted, rows, *times: (observed.append(("verify", rows)),
                                                                      original_speculative(drafted, rows, *times))
    policy.costs.observe_target_step = lambda rows, seconds: (observed.append(("target", rows)),
                                                              original_target(rows, seconds))
    steps = []

    def on_step(record):
        if len(record.request_ids) == len(PROMPTS) and record.num_verified:
            steps.append((list(forwards), list(observed)))
        forwards.clear()
        observed.clear()

    engine.add_step_observer(on_step)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    results = engine.generate_many(PROMPTS, params, speculative=True)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_generate(target, prompt, NEW_TOKENS)
    drafting_plans = [p for p in plans if p.draft_rows][: len(steps)]
    return drafting_plans, steps


def test_riders_apart_run_their_own_forward_and_decode_the_same_text(hybrid_target):
    plans, steps = _run(hybrid_target)
    assert len(steps) > 6 and any(p.riders_apart for p in plans) and not all(p.riders_apart for p in plans)
    for plan, (forwards, observed) in zip(plans, steps):
        rows = 1 + next(iter(plan.draft_rows.values()))
        if plan.riders_apart:  # the drafting request's own rows, then the two riders' target step
            assert forwards == [1, 2] and sorted(observed) == [("target", 2), ("verify", rows)], (plan, forwards)
        else:  # one forward: 2 + rows real rows in a grid of 3 x rows, the riders' padding priced at its share
            real = 2 + rows
            assert forwards == [3] and observed == [("verify", pytest.approx(real + _PADDING_ROW_SHARE * (3 * rows - real)))], (
                plan, forwards)
    with faults.inject("runner.riders_apart_ignored"):
        plans, steps = _run(hybrid_target)
    apart = [forwards for plan, (forwards, _) in zip(plans, steps) if plan.riders_apart]
    assert apart and all(forwards == [3] for forwards in apart)  # what the assertions above reject
