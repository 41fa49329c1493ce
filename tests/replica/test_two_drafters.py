"""Two drafters in one engine: each request drafts with the one its temperature picks.

Drafter A is distilled toward the test target (``dspine_testing.distill``: about 11 accepted
rows per cycle greedy, 1.5 at temperature 1); drafter B is random with A's geometry (about 0.05).
Routing is shown by counts, never times: with A greedy and B sampled, greedy requests accept
many rows and sampled ones almost none, and the fault points that route wrongly make the same
checks fail. Losslessness is shown as for one drafter: greedy output equals target-only greedy
token for token, and sampled output fits the target's distribution (``dspine_testing.lossless``)
in a batch that mixes both kinds of request.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json

import pytest
import torch
from dspine_testing.distill import distilled_pair
from dspine_testing.lossless import fit

from dspine import embedded, faults
from dspine.replica import DrafterGeometryError, Engine, EngineConfig, SamplingParams
from dspine.replica.models.dspine_checkpoint import init_random_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.reference import reference_generate

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
# Measured on this pair (counts, deterministic with the seeds below; means of the requests' means):
# greedy via A 7.8, greedy via B 0.1, sampled via B 0.07, sampled via A 2.3.
HIGH_ACCEPTANCE = 4.0
LOW_ACCEPTANCE = 0.5


def _prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def _random_like(target, drafter, seed: int = 1):
    return init_random_drafter(target, drafter.args, seed=seed).eval()


def _with_candidates(drafter, head_topk: int):
    """The same drafter (weights shared) proposing over ``head_topk`` candidates per row."""
    wider = copy.copy(drafter)
    wider.args = dataclasses.replace(drafter.args, head_topk=head_topk)
    return wider


def _engine(greedy_drafter, sampled_drafter, target, **config) -> Engine:
    knobs = dict(device="cpu", dtype="float32", retrieval="exact", adaptive_speculation=False, max_concurrency=16)
    return Engine(target, greedy_drafter, None, EngineConfig(**{**knobs, **config}), sampled_drafter=sampled_drafter)


def _no_leaks(engine: Engine) -> None:
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}


# ------------------------------------------------------------------ greedy + stats
@pytest.mark.parametrize("adaptive", [False, True], ids=["every-step", "adaptive"])
def test_greedy_output_equals_target_only_and_the_stats_name_the_drafter(adaptive):
    target, drafter = distilled_pair()
    engine = _engine(drafter, _random_like(target, drafter), target, adaptive_speculation=adaptive)
    prompts = _prompts(target.args.vocab_size, [3, 17, 5, 29, 1, 11])
    greedy = engine.generate_many(prompts, GREEDY, speculative=True)
    for prompt, result in zip(prompts, greedy):
        assert result.token_ids == reference_generate(target, prompt, GREEDY.max_new_tokens)
        assert result.stats.drafter == "greedy"
    sampled = engine.generate_many(prompts[:2], SAMPLED, speculative=True)
    assert [r.stats.drafter for r in sampled] == ["sampled", "sampled"]
    target_only = engine.generate(prompts[0], SAMPLED, speculative=False)
    assert target_only.stats.drafter == ""
    _no_leaks(engine)


def _stats_say_sampled(engine: Engine, prompts) -> list[str]:
    """The drafter names of requests just below, at and above the threshold (0.3)."""
    params = [SamplingParams(temperature=t, max_new_tokens=4, ignore_eos=True) for t in (0.0, 0.29, 0.3, 1.5)]
    return [r.stats.drafter for r in engine.generate_many(prompts[:4], params, speculative=True)]


def test_the_threshold_picks_the_drafter():
    target, drafter = distilled_pair()
    engine = _engine(drafter, _random_like(target, drafter), target)
    assert _stats_say_sampled(engine, _prompts(64, [4, 5, 6, 7])) == ["greedy", "greedy", "sampled", "sampled"]
    one = _engine(drafter, None, target)  # one drafter: every speculative request uses it
    assert _stats_say_sampled(one, _prompts(64, [4, 5, 6, 7])) == ["greedy"] * 4


def test_the_stats_test_fails_when_the_choice_ignores_temperature():
    target, drafter = distilled_pair()
    engine = _engine(drafter, _random_like(target, drafter), target)
    with faults.inject("engine.drafter_choice_ignores_temperature"):
        names = _stats_say_sampled(engine, _prompts(64, [4, 5, 6, 7]))
    assert names != ["greedy", "greedy", "sampled", "sampled"]


def test_seed_reproducible_requests_give_the_same_tokens_through_the_sampled_drafter():
    # Gumbel mode: the sampled drafter proposes with the target's noise over its own tables; the tokens
    # are those of target-only decoding with the same seed
    target, drafter = distilled_pair()
    engine = _engine(_random_like(target, drafter), drafter, target)
    prompts = _prompts(target.args.vocab_size, [3, 12, 7])
    params = [SamplingParams(temperature=0.7, top_p=0.9, reproducible=True, seed=s, max_new_tokens=24,
                             ignore_eos=True) for s in range(3)]
    speculative = engine.generate_many(prompts, params, speculative=True)
    target_only = engine.generate_many(prompts, params, speculative=False)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in target_only]
    assert all(r.stats.drafter == "sampled" and r.stats.spec.mean_accepted_len > 1.0 for r in speculative)


def test_a_cycle_of_one_drafter_is_one_draft_call_and_no_merge(monkeypatch):
    # the one-drafter path: with two loaded but every request of a cycle on one, no split and no copy
    from dspine.replica import runner_drafters

    target, drafter = distilled_pair()
    sampled = _random_like(target, drafter)
    engine = _engine(drafter, sampled, target)
    calls = collections.Counter()
    for name, model in (("greedy", drafter), ("sampled", sampled)):
        monkeypatch.setattr(model, "draft", lambda pool, ids, anchors, _f=model.draft, _n=name, **kw: (
            calls.update({(_n, len(ids)): 1}), _f(pool, ids, anchors, **kw))[1])
    monkeypatch.setattr(runner_drafters, "merge_proposals", lambda proposals: calls.update({"merge": 1}) or 1 / 0)
    cycles = []
    engine.add_step_observer(lambda record: cycles.append(len(record.accepted_len)) if record.accepted_len else None)
    engine.generate_many(_prompts(64, [3, 5, 7]), SamplingParams(max_new_tokens=8, ignore_eos=True), speculative=True)
    # every cycle: one call over its whole batch, with the greedy drafter, and nothing merged
    assert sorted(calls.elements()) == sorted(("greedy", n) for n in cycles) and 3 in cycles
    monkeypatch.undo()
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=0, max_new_tokens=8, ignore_eos=True)]
    results = engine.generate_many(_prompts(64, [3, 5]), params, speculative=True)
    assert [r.stats.drafter for r in results] == ["greedy", "sampled"]


# ------------------------------------------------------------------ routing by counts
def _mean_accepted(engine: Engine, vocab: int) -> dict[str, float]:
    """Eight greedy and eight sampled requests in flight together (every cycle holds both groups):
    the mean accepted rows per cycle of each kind, from the requests' own stats."""
    prompts = _prompts(vocab, [3, 7, 12, 20, 5, 9, 14, 4])
    params = [GREEDY] * 8 + [SamplingParams(**{**SAMPLED.__dict__, "seed": i}) for i in range(8)]
    results = engine.generate_many(prompts + prompts, params, speculative=True)
    _no_leaks(engine)
    # the mean of the requests' means: a prompt whose continuation the drafter never learnt runs
    # many cycles at 0 and would dominate a pooled mean
    return {kind: sum(r.stats.spec.mean_accepted_len for r in group) / len(group)
            for kind, group in (("greedy", results[:8]), ("sampled", results[8:]))}


def _routed_right(acceptance: dict[str, float]) -> bool:
    return acceptance["greedy"] > HIGH_ACCEPTANCE and acceptance["sampled"] < LOW_ACCEPTANCE


def test_each_request_drafts_with_its_drafter():
    target, drafter = distilled_pair()
    acceptance = _mean_accepted(_engine(drafter, _random_like(target, drafter), target), target.args.vocab_size)
    assert _routed_right(acceptance), acceptance
    # the other way round: the random drafter serves greedy requests, the distilled one sampled ones
    swapped = _mean_accepted(_engine(_random_like(target, drafter), drafter, target), target.args.vocab_size)
    assert swapped["greedy"] < LOW_ACCEPTANCE and swapped["sampled"] > 1.0, swapped


@pytest.mark.parametrize("fault", ["runner.drafter_groups_swapped", "engine.drafter_choice_ignores_temperature"])
def test_the_routing_test_fails_when_requests_draft_with_the_wrong_drafter(fault):
    target, drafter = distilled_pair()
    engine = _engine(drafter, _random_like(target, drafter), target)
    with faults.inject(fault):
        acceptance = _mean_accepted(engine, target.args.vocab_size)
    assert not _routed_right(acceptance), (fault, acceptance)


# ------------------------------------------------------------------ a mixed batch, lossless
SEEDS_PER_PROMPT = 48
MIXED_NEW_TOKENS = 16


def _mixed_run(sampled_head_topk: int | None = None):
    """One greedy request in every eight among seeded sampled ones (so each step mixes both
    drafters); returns the sampled outputs' fit to the target after checking the greedy outputs
    against target-only greedy and every request's drafter name. ``sampled_head_topk``: the sampled
    drafter proposes over that many candidates (the greedy one over its 16)."""
    # the distilled drafter serves the sampled requests (partial acceptance: the verification at work)
    target, drafter = distilled_pair()
    sampled = drafter if sampled_head_topk is None else _with_candidates(drafter, sampled_head_topk)
    engine = _engine(_random_like(target, drafter), sampled, target, verify_threshold=0.05)
    assert engine.runner.drafters["sampled"].tail_tables.head_topk == sampled.args.head_topk
    prompts = _prompts(target.args.vocab_size, [3, 7, 12, 20])
    sampled_params = SamplingParams(temperature=1.0, max_new_tokens=MIXED_NEW_TOKENS, ignore_eos=True)
    greedy_params = SamplingParams(temperature=0.0, max_new_tokens=MIXED_NEW_TOKENS, ignore_eos=True)
    batch, params = [], []
    for seed in range(SEEDS_PER_PROMPT):
        for prompt in prompts:
            batch.append(prompt)
            params.append(greedy_params if seed % 8 == 0 else SamplingParams(**{**sampled_params.__dict__,
                                                                                "seed": seed}))
    results = engine.generate_many(batch, params, speculative=True)
    _no_leaks(engine)
    samples: dict[tuple[int, ...], list[list[int]]] = collections.defaultdict(list)
    cycles = accepted = 0
    for prompt, p, result in zip(batch, params, results):
        if p.is_greedy:
            assert result.token_ids == reference_generate(target, prompt, MIXED_NEW_TOKENS)
            assert result.stats.drafter == "greedy"
        else:
            assert result.stats.drafter == "sampled"
            samples[tuple(prompt)].append(result.token_ids)
            cycles += result.stats.spec.num_cycles
            accepted += result.stats.spec.num_accepted_tokens
    assert accepted / cycles > 0.9  # the sampled drafter really proposed what the target accepts
    result = fit(target, samples, sampled_params, first_position=1)
    assert result.num_tokens >= 0.99 * 4 * (SEEDS_PER_PROMPT - SEEDS_PER_PROMPT // 8) * (MIXED_NEW_TOKENS - 1)
    return result


def test_a_mixed_batch_is_lossless_for_both_kinds():
    result = _mixed_run()
    assert result.pvalue > 1e-4, result


def test_a_sampled_drafter_with_more_candidates_is_lossless_in_a_mixed_batch():
    """The sampled drafter proposes over 32 candidates per row, the greedy one over 16: the merged
    proposal pads the greedy rows, and both kinds stay lossless."""
    result = _mixed_run(sampled_head_topk=32)
    assert result.pvalue > 1e-4, result


def test_proposals_of_different_widths_merge_into_the_same_distributions():
    """Merging a K=3 and a K=5 proposal: every row's dense q, its drawn token's slot and the
    verification of the merged batch are each group's own (with the same p and coins)."""
    from dspine.replica import verify
    from dspine.replica.runner_drafters import merge_proposals
    from dspine.replica.tail import Proposal

    g = torch.Generator().manual_seed(4)
    vocab, rows = 11, 4

    def proposal(nb: int, k: int) -> Proposal:
        cand = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(nb * rows)]).view(nb, rows, k)
        q = torch.rand(nb, rows, k, generator=g, dtype=torch.float64)
        q = q / q.sum(-1, keepdim=True)
        choice = torch.randint(0, k, (nb, rows), generator=g)
        return Proposal(cand.gather(2, choice[..., None]).squeeze(2), q, cand, choice)

    narrow, wide = proposal(2, 3), proposal(3, 5)
    merged = merge_proposals([narrow, wide])
    assert merged.q.shape == (5, rows, 5)
    assert torch.equal(merged.dense_q(vocab), torch.cat([narrow.dense_q(vocab), wide.dense_q(vocab)]))
    assert torch.equal(merged.cand_ids.gather(2, merged.choice[..., None]).squeeze(2), merged.draft_ids)
    target_probs = (2 * torch.randn(5, rows + 1, vocab, generator=g)).softmax(-1)
    coins, final_coins = torch.rand(5, rows, generator=g), torch.rand(5, generator=g)
    together = verify.verify_sampled(merged.draft_ids, merged.q, target_probs, coins, final_coins,
                                     draft_q_ids=merged.cand_ids)
    apart = [verify.verify_sampled(p.draft_ids, p.q, target_probs[rows_], coins[rows_], final_coins[rows_],
                                   draft_q_ids=p.cand_ids)
             for p, rows_ in ((narrow, slice(0, 2)), (wide, slice(2, 5)))]
    assert torch.equal(together.output_ids, torch.cat([r.output_ids for r in apart]))
    assert torch.equal(together.accepted_len, torch.cat([r.accepted_len for r in apart]))


def test_the_mixed_batch_test_fails_when_proposals_merge_out_of_order():
    with faults.inject("runner.proposals_merged_out_of_order"):
        result = _mixed_run()
    assert result.pvalue < 1e-6, result


# ------------------------------------------------------------------ loading
def test_a_sampled_drafter_of_another_geometry_is_refused_naming_the_field():
    target, drafter = distilled_pair()
    other = DraftArgs.for_target(target.args, window=32, num_retrieve=drafter.args.num_retrieve)
    with pytest.raises(DrafterGeometryError, match="window") as info:
        _engine(drafter, init_random_drafter(target, other, seed=1).eval(), target)
    assert info.value.field == "window"
    with pytest.raises(ValueError, match="sampled_draft_dir"):  # a sampled drafter alone
        _engine(None, drafter, target)
    # the tail's candidate counts are the drafter's own: they may differ
    own_tail = dataclasses.replace(drafter.args, head_topk=8, num_retrieve=16)
    engine = _engine(drafter, init_random_drafter(target, own_tail, seed=1).eval(), target)
    assert engine.runner.drafters["sampled"].tail_tables.head_topk == 8


def test_from_pretrained_loads_two_drafters_and_checks_geometry_before_loading(tmp_path):
    config = EngineConfig(device="cpu", dtype="float32", max_concurrency=2, retrieval="bf16")
    engine = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, config,
                                    sampled_draft_dir=embedded.DRAFT_DIR)
    description = engine.describe()
    assert description.drafters == ("greedy", "sampled")
    assert description.sampled_draft_min_temperature == config.sampled_draft_min_temperature
    assert any(line.name == "sampled drafter" and line.bytes > 0 for line in engine.memory_plan.lines)
    sampled_tables, greedy_tables = engine.runner.drafters["sampled"].tail_tables, engine.runner.tail_tables
    assert sampled_tables.token_head_write is not greedy_tables.token_head_write  # its own tables
    assert sampled_tables.retrieval == greedy_tables.retrieval  # ... but one scan copy of the shared head
    for name in ("head_fp8", "head_bf16"):
        assert getattr(sampled_tables, name) is getattr(greedy_tables, name)
    result = engine.generate([1, 2, 3], SamplingParams(temperature=0.8, seed=0, max_new_tokens=6), speculative=True)
    assert result.stats.drafter == "sampled"
    one = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, config).describe()
    assert (one.drafters, one.sampled_draft_min_temperature) == (("greedy",), None)

    # a config.json of another block size: refused from the config files, before any weight is read
    bad = tmp_path / "bad-draft"
    bad.mkdir()
    data = json.loads((embedded.DRAFT_DIR / "config.json").read_text())
    data["block_size"] = data.get("block_size", 16) // 2
    (bad / "config.json").write_text(json.dumps(data))  # no weights file: loading it would fail otherwise
    with pytest.raises(DrafterGeometryError, match="block_size"):
        Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, config, sampled_draft_dir=bad)


def test_sampled_drafter_config_is_validated():
    with pytest.raises(ValueError, match="sampled_draft_min_temperature"):
        EngineConfig(sampled_draft_min_temperature=0.0)



def test_the_memory_plan_counts_the_second_drafter_and_shares_the_pool():
    from dspine.replica.memory_plan import PlanConfig, plan_memory

    target, drafter = distilled_pair()
    config = dict(device_memory_bytes=10**12, max_concurrency=4, max_seq_len=256, retrieval="bf16")
    one = {line.name: line.bytes for line in plan_memory(target.args, drafter.args, PlanConfig(**config)).lines}
    two = {line.name: line.bytes for line in
           plan_memory(target.args, drafter.args, PlanConfig(**config, num_drafters=2)).lines}
    assert set(two) - set(one) == {"sampled drafter"}
    assert two["sampled drafter"] == sum(one[n] for n in ("drafter weights", "tail tables", "codebook"))
    # one pool and one retrieval copy of the (shared) LM head for both
    assert two["draft pool"] == one["draft pool"] and two["retrieval head copy"] == one["retrieval head copy"] > 0
    with pytest.raises(ValueError, match="num_drafters"):
        PlanConfig(**config, num_drafters=3)
