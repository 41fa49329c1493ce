"""A speculative request's draft context: deferred positions (prompt, target-only steps) reach it
in order and only when the request drafts (replica/runner_draft_context.py)."""

from __future__ import annotations

import pytest
import torch

from dspine import faults
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.reference import reference_generate
from dspine.replica.runner_draft_context import MAX_DEFERRED_POSITIONS
from dspine.replica.speculation_policy import StepPlan

pytestmark = pytest.mark.timeout(120)


def _engine(target, window: int = 64) -> Engine:
    from dspine.replica.models.dspine_checkpoint import init_random_drafter
    from dspine.replica.models.dspine_config import DraftArgs

    args = DraftArgs.for_target(target.args, window=window, num_retrieve=32)
    drafter = init_random_drafter(target, args, seed=0).eval()
    return Engine(target, drafter, None, EngineConfig(device="cpu", dtype="float32", adaptive_speculation=True,
                                                      verify_threshold=0.0))


def _plan(engine, drafts_on_step) -> None:
    """Replace the policy's plan: request drafts 3 rows on decode steps where ``drafts_on_step(i)``."""
    step = [0]

    def plan(candidates, num_target_only=0, sampled=frozenset(), **pricing):
        step[0] += 1
        if drafts_on_step(step[0]):
            return StepPlan({r: min(3, m) for r, m in candidates.items() if m > 0})
        return StepPlan({})

    engine.scheduler.policy.plan = plan


def _record_appends(engine) -> list[tuple[int, torch.Tensor]]:
    """Every append to a draft context: (the first position it writes, its features [T, F, H])."""
    appends = []
    drafter, pool = engine.runner.drafter, engine.runner.draft_pool
    original = drafter.append_context

    def append_context(pool_, request_ids, features):
        for request_id, f in zip(request_ids, features):
            appends.append((pool.num_positions(request_id), f.clone()))
        return original(pool_, request_ids, features)

    drafter.append_context = append_context
    return appends


def test_a_request_that_never_drafts_never_runs_the_drafter(hybrid_target):
    """Target-only on every step: neither its prompt nor its tokens cost a drafter pass, and its
    output is the target's."""
    prompt = [5, 9, 2, 7, 1, 3]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)

    def run():
        engine = _engine(hybrid_target)
        _plan(engine, lambda step: False)
        appends = _record_appends(engine)
        result = engine.generate(prompt, params, speculative=True)
        assert result.token_ids == reference_generate(hybrid_target, prompt, 40)
        assert engine.num_live_states()["draft_slots"] == 0
        return appends

    assert run() == []
    with faults.inject("runner.context_appended_at_once"):
        appends = run()
    assert len(appends) == 1 + 39  # the prompt, then each target-only step's position


def test_deferred_positions_reach_the_draft_context_in_order(hybrid_target):
    """Target-only for 9 steps, then drafting: the drafter's context holds exactly the positions
    (prompt, target-only tokens, accepted tokens) and features an at-once append gives it."""
    prompt = [3, 1, 4, 1, 5, 9, 2]
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)

    def run():
        engine = _engine(hybrid_target)
        _plan(engine, lambda step: step >= 10)
        appends = _record_appends(engine)
        result = engine.generate(prompt, params, speculative=True)
        assert result.token_ids == reference_generate(hybrid_target, prompt, 30)
        assert result.stats.spec.num_cycles > 3
        return appends

    deferred = run()
    with faults.inject("runner.context_appended_at_once"):
        at_once = run()
    assert len(deferred) < len(at_once)
    assert deferred[0][0] == 0 and at_once[0][0] == 0
    for appends in (deferred, at_once):  # contiguous: no position skipped or written twice
        for (start, f), (next_start, _) in zip(appends, appends[1:]):
            assert next_start == start + f.shape[0]
    positions = min(sum(f.shape[0] for _, f in deferred), sum(f.shape[0] for _, f in at_once))
    assert positions >= len(prompt) + 9
    torch.testing.assert_close(torch.cat([f for _, f in deferred])[:positions],
                               torch.cat([f for _, f in at_once])[:positions], rtol=0, atol=0)


def test_a_long_target_only_stretch_is_appended_in_bounded_pieces(hybrid_target):
    """Kept positions never exceed the bound (the window here): they go to the context once it is
    reached, so a request that decodes target-only for long holds bounded memory."""
    window = 8
    assert window < MAX_DEFERRED_POSITIONS
    engine = _engine(hybrid_target, window=window)
    _plan(engine, lambda step: False)
    appends = _record_appends(engine)
    prompt = [2, 7, 1]
    result = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True),
                             speculative=True)
    assert result.token_ids == reference_generate(hybrid_target, prompt, 30)
    assert [f.shape[0] for _, f in appends] == [window] * ((len(prompt) + 29) // window)
