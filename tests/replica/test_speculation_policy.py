"""Adaptive speculation: the cost model, the acceptance profiles and the policy's choices, counted.

Nothing here times anything: costs are fed to the model by the tests, or (engine tests) the policy
runs on whatever this machine measures and the assertions hold for any positive costs.
"""

from __future__ import annotations

import pytest
import torch

from dspine import faults

from dspine.replica import Engine, EngineConfig, SamplingParams
from dspine.replica.reference import reference_generate
from dspine.replica.speculation_policy import AcceptanceProfile, LinearCost, SpeculationPolicy
from dspine.replica.tail import Proposal

ROWS = 15


def test_linear_cost_recovers_a_line_and_follows_drift():
    cost = LinearCost(prior_slope_share=0.05)
    assert cost.predict(4) is None
    for rows in (1, 16, 4, 9) * 5:
        cost.observe(rows, 0.004 + 0.0003 * rows)
    intercept, slope = cost.coefficients()
    assert intercept == pytest.approx(0.004, rel=1e-6) and slope == pytest.approx(0.0003, rel=1e-6)
    for rows in (1, 16) * 40:  # the machine got twice as slow
        cost.observe(rows, 2 * (0.004 + 0.0003 * rows))
    assert cost.predict(10) == pytest.approx(2 * (0.004 + 0.003), rel=0.02)


def test_linear_cost_with_one_x_uses_the_prior_shape():
    cost = LinearCost(prior_slope_share=0.1)
    cost.observe(1, 0.011)
    assert cost.predict(1) == pytest.approx(0.011)
    assert cost.predict(11) == pytest.approx(0.011 / 1.1 * 2.1)


def test_acceptance_profile_learns_per_row_and_shares_a_prior():
    engine_wide = AcceptanceProfile(ROWS)
    request = AcceptanceProfile(ROWS, prior=engine_wide)
    assert request.gains(3) == pytest.approx([0.5, 0.25, 0.125])
    for _ in range(20):  # rows 1-2 always accepted, row 3 never
        request.observe(num_verified=5, accepted_len=2)
    gains = request.gains(5)
    assert gains[0] > 0.95 and gains[1] > 0.9 and gains[2] < 0.1
    assert request.conditional(4) == pytest.approx(engine_wide.conditional(4))  # never observed: the prior
    fresh = AcceptanceProfile(ROWS, prior=engine_wide)
    assert fresh.gains(1)[0] > 0.9  # a new request starts from what the engine has seen


def _policy_with_costs(forward=(0.004, 0.0003), overhead=(0.002, 0.001)) -> SpeculationPolicy:
    policy = SpeculationPolicy(ROWS)
    for rows in (1, 8, 16, 30):
        policy.costs.target_forward.observe(rows, forward[0] + forward[1] * rows)
        policy.costs.verify_forward.observe(rows, forward[0] + forward[1] * rows)
        policy.costs.draft_overhead.observe(rows % 8 + 1, overhead[0] + overhead[1] * (rows % 8 + 1))
    return policy


def test_a_perfect_profile_verifies_every_row_and_a_useless_one_none():
    policy = _policy_with_costs()
    for _ in range(10):
        policy.observe_cycle("good", ROWS, ROWS)
        policy.observe_cycle("bad", ROWS, 0)
    plan = policy.plan({"good": ROWS, "bad": ROWS})
    assert plan.draft_rows["good"] == ROWS
    # "bad" drafts nothing: it rides in good's verify forward with one row
    assert "bad" not in plan.draft_rows
    alone = policy.plan({"bad": ROWS})
    assert alone.draft_rows == {}
    assert policy.plan({"good": 3}).draft_rows == {"good": 3}  # never past the remaining output


def _best_rows_by_brute_force(policy, candidates, num_target_only):
    """Every prefix of all rows sorted by gain, each priced by CostModel.step_seconds."""
    ranked = sorted(((gain, r) for r, m in candidates.items() for gain in policy.profile(r).gains(m)),
                    key=lambda item: -item[0])
    n = len(candidates)
    best_rate = (n + num_target_only) / policy.costs.step_seconds(0, 0, n + num_target_only)
    best_count, tokens, drafting = 0, float(n + num_target_only), set()
    for count, (gain, r) in enumerate(ranked, start=1):
        tokens += gain
        drafting.add(r)
        seconds = policy.costs.step_seconds(len(drafting), len(drafting) + count, n - len(drafting) + num_target_only)
        if tokens / seconds > best_rate:
            best_rate, best_count = tokens / seconds, count
    rows = {}
    for _, r in ranked[:best_count]:
        rows[r] = rows.get(r, 0) + 1
    return rows


def test_the_fast_plan_is_the_brute_force_plan():
    """The plan merges per-request rows by gain and stops early; it must pick exactly the rows the
    brute-force search over every prefix picks (a late-bound request id in the merge, or an early
    stop that is not exact, changes them)."""
    g = torch.Generator().manual_seed(0)
    checked_drafting = 0
    for trial in range(60):
        row_seconds = [0.00002, 0.0003, 0.002][trial % 3]
        policy = _policy_with_costs(forward=(0.004, row_seconds), overhead=(0.001 * (trial % 4), 0.0005))
        candidates = {}
        for i in range(1 + trial % 8):
            accepted = torch.randint(0, ROWS + 1, (12,), generator=g).tolist()
            for a in accepted:
                policy.observe_cycle(f"r{i}", ROWS, a)
            candidates[f"r{i}"] = int(torch.randint(1, ROWS + 1, (1,), generator=g))
        num_target_only = trial % 3
        expected = _best_rows_by_brute_force(policy, candidates, num_target_only)
        assert policy._best_rows(candidates, num_target_only) == expected, trial
        checked_drafting += bool(expected)
    assert 10 < checked_drafting < 60  # both outcomes were exercised


def test_a_requests_estimates_follow_its_prior_after_it_was_read():
    engine_wide = AcceptanceProfile(ROWS)
    request = AcceptanceProfile(ROWS, prior=engine_wide)
    other = AcceptanceProfile(ROWS, prior=engine_wide)
    before = request.gains(4)  # read (and cached) before the prior learns anything
    for _ in range(20):
        other.observe(num_verified=5, accepted_len=5)
    assert request.gains(4)[3] > before[3] + 0.2  # never observed itself: it follows the engine


@pytest.mark.parametrize("row_seconds,expected_rows", [(0.0015, 4), (0.0001, 6)])
def test_rows_are_bought_while_they_pay(row_seconds, expected_rows):
    """Rows 1-4 always accepted, row 5 half the time, row 6 half of that, row 7 never: a row is
    worth its cost while its expected tokens per second beat the plan's so far (about 450 tok/s
    with 4 rows at 1.5 ms per row, where row 5's half token per 1.5 ms is not worth it)."""
    policy = _policy_with_costs(forward=(0.004, row_seconds), overhead=(0.001, 0.0))
    for _ in range(30):
        for accepted in (4, 5, 6, 4):
            policy.observe_cycle("r", ROWS, accepted)
    assert policy.plan({"r": ROWS}).draft_rows["r"] == expected_rows


def test_probes_back_off_while_speculation_loses():
    policy = _policy_with_costs()
    for _ in range(10):
        policy.observe_cycle("bad", ROWS, 0)
    drafted = [bool(policy.plan({"bad": ROWS}).draft_rows) for _ in range(200)]
    probes = [i for i, d in enumerate(drafted) if d]
    assert probes[:5] == [3, 11, 27, 59, 123]  # every 4th step, then 8th, 16th, 32nd, 64th
    assert sum(drafted) / len(drafted) < 0.1


def test_each_kind_backs_off_on_its_own_schedule():
    """A sampled request's probes back off to every 128th step (a greedy one's to every 64th), and a
    long losing stretch of sampled requests does not delay the first probe of a greedy request."""
    policy = _policy_with_costs()
    policy.profile("s", sampled=True)  # a sampled request (the engine plans before it observes)
    for _ in range(10):
        policy.observe_cycle("s", ROWS, 0)
    sampled = frozenset({"s"})
    drafted = [bool(policy.plan({"s": ROWS}, sampled=sampled).draft_rows) for _ in range(400)]
    probes = [i for i, d in enumerate(drafted) if d]
    assert probes[:7] == [3, 11, 27, 59, 123, 251, 379]  # 8, 16, 32, 64, then 128 apart
    assert policy.probe_interval("sampled") == 128 and policy.probe_interval("greedy") == 4
    for _ in range(10):
        policy.observe_cycle("g", ROWS, 0)
    first_greedy_probe = next(i for i in range(200)
                              if "g" in policy.plan({"s": ROWS, "g": ROWS}, sampled=sampled).draft_rows)
    assert first_greedy_probe == 3  # its own schedule starts at every 4th step


def _lucky_probes_unlucky_follow_ups(steps: int = 400) -> tuple[list[int], int]:
    """A request whose probes accept every row and whose planned drafting steps accept none (a lucky
    probe lifts the estimates, the next steps do not pay): ``(probe steps, drafting steps)``."""
    policy = _policy_with_costs()
    for _ in range(10):
        policy.observe_cycle("r", ROWS, 0)
    probes, drafted = [], 0
    for step in range(steps):
        plan = policy.plan({"r": ROWS})
        rows = plan.draft_rows.get("r", 0)
        if rows:
            drafted += 1
            probes += [step] if plan.is_probe else []
            policy.observe_cycle("r", rows, rows if plan.is_probe else 0)
    return probes, drafted


def test_a_drafting_step_that_did_not_pay_keeps_the_probes_backing_off():
    """Only a planned drafting step that paid restarts the probes at every 4th step; one that did
    not (accepted less than a target-only step's worth) leaves the back-off where it was."""
    probes, drafted = _lucky_probes_unlucky_follow_ups()
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) <= 10 and gaps[:3] == sorted(gaps[:3]) and min(gaps[2:]) >= 32, probes
    assert drafted / 400 < 0.2
    with faults.inject("policy.probe_interval_reset_by_any_draft"):
        probes, drafted = _lucky_probes_unlucky_follow_ups()
    assert len(probes) > 20 and drafted / 400 > 0.5  # the old reset: a probe every ~10 steps


def test_a_drafting_step_that_paid_restarts_the_probes():
    policy = _policy_with_costs()
    for _ in range(10):
        policy.observe_cycle("r", ROWS, 0)
    for _ in range(60):  # back off: the next probe is now 32 steps away
        plan = policy.plan({"r": ROWS})
        if plan.draft_rows:
            policy.observe_cycle("r", plan.draft_rows["r"], 0)
    assert policy.probe_interval("greedy") >= 32
    for _ in range(10):  # the text became predictable: planned steps draft and pay
        policy.observe_cycle("r", ROWS, ROWS)
    plan = policy.plan({"r": ROWS})
    assert plan.draft_rows and not plan.is_probe
    policy.observe_cycle("r", plan.draft_rows["r"], plan.draft_rows["r"])
    policy.plan({"r": ROWS})  # the paid step is judged when the next step is planned
    assert policy.probe_interval("greedy") == 4


# ------------------------------------------------------------- through the engine
def _engine(target, drafter_seed: int = 0, **config):
    from dspine.replica.models.dspine_checkpoint import init_random_drafter
    from dspine.replica.models.dspine_config import DraftArgs

    args = DraftArgs.for_target(target.args, window=8, num_retrieve=32)
    drafter = init_random_drafter(target, args, seed=drafter_seed).eval()
    return Engine(target, drafter, None, EngineConfig(device="cpu", dtype="float32", adaptive_speculation=True,
                                                      **config))


def _record_steps(engine) -> list[dict[str, int]]:
    steps: list[dict[str, int]] = []
    engine.add_step_observer(lambda record: steps.append(dict(record.num_verified)) if record.request_ids else None)
    return steps


def test_an_always_wrong_drafter_stops_drafting_after_warm_up(hybrid_target):
    engine = _engine(hybrid_target)
    steps = _record_steps(engine)
    prompt = [5, 9, 2, 7]
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
    result = engine.generate(prompt, params, speculative=True)
    assert result.token_ids == reference_generate(hybrid_target, prompt, 300)
    decode_steps = steps[1:]  # step 0 is the prefill
    after_warm_up = decode_steps[20:]
    share = sum(1 for s in after_warm_up if s) / len(after_warm_up)
    assert 0 < share < 0.1, share  # apart from probes, target-only
    policy = engine.scheduler.policy
    assert policy.num_decode_steps == len(decode_steps)
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}


def test_a_perfect_drafter_gets_every_row_verified(hybrid_target):
    engine = _engine(hybrid_target, verify_threshold=0.0)
    steps = _record_steps(engine)
    prompt = [3, 1, 4, 1, 5]
    truth = reference_generate(hybrid_target, prompt, 120)

    def propose(request_ids, requests, draft_out, anchors, params, generators):
        done = len(requests[request_ids[0]].output_token_ids)
        draft = torch.tensor([(truth[done:done + ROWS] + [0] * ROWS)[:ROWS]])
        cand = draft[..., None].repeat(1, 1, 16)
        q = torch.zeros(cand.shape, dtype=torch.float64)
        q[..., 0] = 1.0
        return Proposal(draft_ids=draft, q=q, cand_ids=cand, choice=torch.zeros_like(draft))

    engine.runner.propose = propose  # its proposal is the target's own argmax
    params = SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True)
    result = engine.generate(prompt, params, speculative=True)
    assert result.token_ids == truth
    produced = 1  # the prefill's token
    for step in steps[1:]:
        assert step, "a decode step did not draft"
        verified = next(iter(step.values()))
        assert verified == min(ROWS, params.max_new_tokens - produced - 1)
        produced += verified + 1
