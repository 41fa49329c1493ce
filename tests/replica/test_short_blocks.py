"""A cycle drafts only the rows its plan verifies: the drafter and the tail run a block of the
anchor plus the longest planned row count, whose rows equal the whole block's first rows."""

from __future__ import annotations

import pytest
import torch

from dspine import faults
from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.reference import reference_generate
from dspine.replica.speculation_policy import StepPlan

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 9, 2, 7, 1, 3], [3, 1, 4, 1, 5, 9, 2, 6]]


def _engine(target) -> Engine:
    from dspine.replica.models.dspine_checkpoint import init_random_drafter
    from dspine.replica.models.dspine_config import DraftArgs

    args = DraftArgs.for_target(target.args, window=64, num_retrieve=32)
    drafter = init_random_drafter(target, args, seed=0).eval()
    return Engine(target, drafter, None, EngineConfig(device="cpu", dtype="float32", adaptive_speculation=True,
                                                      verify_threshold=0.0))


def _plan_rows(engine) -> list[dict[str, int]]:
    """Replace the policy's plan: on decode step i the requests draft 1 + i % 5 and 3 + i % 7 rows
    (in the order the plan sees them); returns the plans made."""
    plans = []

    def plan(candidates, num_target_only=0, sampled=frozenset(), **pricing):
        step = len(plans)
        wanted = [1 + step % 5, 3 + step % 7]
        rows = {r: min(wanted[i % 2], m) for i, (r, m) in enumerate(sorted(candidates.items())) if m > 0}
        plans.append(rows)
        return StepPlan(rows)

    engine.scheduler.policy.plan = plan
    return plans


def _record_block_rows(engine) -> list[int]:
    rows = []
    drafter = engine.runner.drafter
    original = drafter.forward_block

    def forward_block(pool, request_ids, anchor_ids, x):
        rows.append(x.shape[1])
        return original(pool, request_ids, anchor_ids, x)

    drafter.forward_block = forward_block
    return rows


def _run(target):
    engine = _engine(target)
    plans = _plan_rows(engine)
    block_rows = _record_block_rows(engine)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    results = engine.generate_many(PROMPTS, params, speculative=True)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_generate(target, prompt, 24)
    return [p for p in plans if p], block_rows


def test_a_cycle_drafts_only_the_rows_its_plan_verifies(hybrid_target):
    plans, block_rows = _run(hybrid_target)
    assert len(block_rows) == len(plans) > 10
    assert block_rows == [1 + max(p.values()) for p in plans]
    assert len(set(block_rows)) > 3  # blocks of several lengths were drafted
    with faults.inject("runner.whole_block_drafted"):
        _, whole = _run(hybrid_target)
    assert set(whole) == {_block_size(hybrid_target)}


def _block_size(target) -> int:
    from dspine.replica.models.dspine_config import DraftArgs

    return DraftArgs.for_target(target.args, window=64, num_retrieve=32).block_size


def test_a_short_block_is_the_whole_blocks_first_rows(hybrid_target):
    """Every op of a block is per row but attention, which is causal inside the block: a block of
    R rows equals the first R rows of the whole block, in the drafter's outputs and in the tail's
    sampled proposal from the same coins; and the short block draws a whole block's coins, so a
    request's random stream never depends on its plan."""
    from dspine.replica import tail

    engine = _engine(hybrid_target)
    _plan_rows(engine)
    drafter, tables = engine.runner.drafter, engine.runner.tail_tables
    block = _block_size(hybrid_target)
    original = drafter.draft
    compared = []

    def draft(pool, request_ids, anchor_ids, compute_logits=False, num_rows=None):
        short = original(pool, request_ids, anchor_ids, compute_logits, num_rows)
        whole = original(pool, request_ids, anchor_ids, compute_logits, None)
        rows = short.hidden.shape[1]
        for name in ("hidden", "x_last", "rms", "codes"):
            torch.testing.assert_close(getattr(short, name), getattr(whole, name)[:, :rows], rtol=1e-5, atol=1e-5)
        nb = len(request_ids)
        proposals, states = [], []
        for out in (short, whole):
            generators = [torch.Generator().manual_seed(7 + b) for b in range(nb)]
            proposals.append(tail.propose(out, tables, anchor_ids, torch.full((nb,), 0.8), torch.zeros(nb, dtype=torch.long),
                                          torch.ones(nb), generators, num_coins=block - 1))
            states.append([g.get_state() for g in generators])
        assert torch.equal(proposals[0].draft_ids, proposals[1].draft_ids[:, : rows - 1])
        torch.testing.assert_close(proposals[0].q, proposals[1].q[:, : rows - 1])
        assert all(torch.equal(a, b) for a, b in zip(*states))  # the same coins consumed
        compared.append(rows)
        return short

    drafter.draft = draft
    engine.generate_many(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True),
                         speculative=True)
    assert compared and min(compared) < block
