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

__all__ = ["FAULTS", "MEMORY_FAULTS", "ENGINE_FAULTS", "EDGE_FAULTS", "BENCH_FAULTS", "active", "inject"]

FAULTS: dict[str, str] = {
    "tail.q_from_wrong_row": "the tail's q (and confidence) read the table row of the token's own slot "
                             "instead of its predecessor's (predecessor_slots returns the choice)",
    "tail.confidence_reads_own_draw": "dynamic verification's confidence of row t is q_t(y_t), the "
                                      "probability of the token drawn at that row",
    "verify.always_accept": "sampled verification accepts every draft token",
    "verify.recover_from_p": "the token after a rejection is drawn from p instead of the residual [p - q]+",
    "verify.bonus_from_residual": "after a truncated verify (num_verified < K) accepted in full, the bonus is "
                                  "drawn from the residual [p - q]+ of the next row instead of from p",
    "runner.p_without_temperature": "the target's p used by verification ignores the request's temperature",
    "runner.p_without_top_p": "the target's p used by verification ignores the request's top-p",
    "penalties.same_counts_for_every_row": "every row of a verified block is penalised with the context's "
                                           "counts, not seeing the tokens drafted at the rows before it",
    "gumbel.noise_halved": "seed-reproducible sampling adds half the Gumbel noise (a sharpened distribution)",
}

# Faults of memory management, not of losslessness (so no sampled-fit case covers them): each is
# caught by the memory tests named beside it.
MEMORY_FAULTS: dict[str, str] = {
    # tests/replica/test_memory_admission.py::test_draft_pool_running_out_never_fails_an_admitted_request
    "runner.no_draft_pool_fallback": "a speculative request the draft KV pool cannot extend is drafted anyway "
                                     "(DraftPoolExhausted fails it) instead of decoding target-only",
    # tests/replica/test_chunked_prefill.py::test_drafter_context_check_fails_when_chunk_features_are_dropped
    "runner.chunk_features_dropped": "chunked prefill appends only the last chunk's features to the drafter's "
                                     "context",
    # tests/replica/test_memory_admission.py::test_admission_check_fails_when_memory_is_ignored
    "scheduler.admission_ignores_memory": "the scheduler starts a waiting request whatever its reservation",
    # tests/replica/models/test_row_packing.py
    "target.pad_rows_for_gemms": "a ragged forward_step runs its projections, MLPs and LM head on every "
                                 "padded row of the [B, T] grid, not only the requests' real rows",
    # tests/replica/models/test_paged_kv.py and test_target_kv_engine.py
    "paged_kv.write_padded_rows": "a ragged paged step writes every padded row of the batch into the "
                                  "target K/V pool, not only the requests' new rows",
    "paged_kv.slot_off_by_one": "the paged step stores each new K/V row one slot past its position",
    "paged_kv.free_keeps_blocks": "freeing a request (finish, cancel, failure) does not return its target "
                                  "K/V blocks to the pool",
}

# Faults of the engine's threading, caught by the tests named beside them.
ENGINE_FAULTS: dict[str, str] = {
    # tests/replica/test_engine_intake.py
    "engine.admission_waits_for_step": "add_request and cancel wait for the step in progress (the step lock "
                                       "around the model run) before they refuse, admit or cancel",
    # tests/replica/test_two_drafters.py::test_the_stats_test_fails_when_the_choice_ignores_temperature
    "engine.drafter_choice_ignores_temperature": "with two drafters loaded, every speculative request is given "
                                                 "the greedy drafter whatever its temperature",
    # tests/replica/test_two_drafters.py::test_the_routing_test_fails_when_the_groups_swap_drafters
    "runner.drafter_groups_swapped": "a cycle whose batch holds both drafters' requests drafts and proposes each "
                                     "group with the other group's drafter and tail tables",
    # tests/replica/test_two_drafters.py::test_the_mixed_batch_test_fails_when_proposals_merge_out_of_order
    "runner.proposals_merged_out_of_order": "the drafter groups' proposals are merged with the draft tokens in "
                                            "batch order but their q and candidates in the other group order",
    # tests/replica/test_speculation_policy.py::test_a_paid_step_restarts_only_its_own_batch_sizes_probes
    "policy.probe_schedule_shared_across_batches": "one probe schedule per kind of request for every batch size: "
                                                   "a planned step that paid with 2 requests restarts the "
                                                   "probes of 8",
    # tests/replica/test_speculation_policy.py::test_a_drafting_step_that_did_not_pay_keeps_the_probes_backing_off
    "policy.probe_interval_reset_by_any_draft": "the probes' back-off starts over after every planned drafting "
                                                "step, whether it paid or not",
    # tests/replica/test_short_blocks.py::test_a_cycle_drafts_only_the_rows_its_plan_verifies
    "runner.whole_block_drafted": "the drafter and the tail run the whole block in every cycle, whatever the "
                                  "rows the step's plan verifies",
    # tests/replica/test_draft_context.py::test_a_request_that_never_drafts_never_runs_the_drafter
    "runner.context_appended_at_once": "a speculative request's committed positions (its prompt's, and those "
                                       "of its target-only steps) go to its draft context at once, one "
                                       "drafter pass each, instead of waiting until it drafts",
    # tests/replica/test_speculation_policy.py::test_rows_the_confidence_cut_dropped_count_against_the_forecast
    "policy.acceptance_against_verified_rows": "a cycle's acceptance is observed against the rows it verified, "
                                               "not the rows its plan drafted (rows the confidence cut dropped "
                                               "never count against the forecast)",
    # tests/replica/test_speculation_policy.py::test_planned_cycles_that_accept_less_than_forecast_lower_the_forecasts
    "policy.forecast_uncalibrated": "a plan takes the requests' estimates at face value, though its drafting "
                                    "requests are those whose estimates are highest just then (the cycles of "
                                    "planned steps accept less than forecast)",
    # tests/replica/test_speculation_policy.py::test_the_fast_plan_is_the_brute_force_plan
    "policy.plan_bound_unsound": "the plan skips a row count by a bound on its k-request plans that holds for "
                                 "k = 1 and k = all but not between (all the requests' tokens for their cost)",
    # tests/replica/test_drain_pricing.py::test_a_closed_group_does_not_draft_a_subset_that_pays_only_under_load,
    # ::test_a_closed_group_makes_no_probe_that_could_not_pay_even_if_it_hit
    # and ::test_a_lone_laggard_drafts_where_a_loaded_replica_would_not
    "policy.drain_unpriced": "a plan values every accepted token in full whether or not freed slots are "
                             "refilled, so requests of a closed group run ahead and leave the others a "
                             "thinner, dearer batch",
    # tests/replica/test_slot_refills.py::test_a_closed_group_reads_as_unrefilled
    "scheduler.refills_unmeasured": "the scheduler reports every freed slot as refilled (a closed group is "
                                    "priced as a replica under load)",
    # tests/replica/test_speculation_policy.py::test_quiet_steps_end_when_a_cycle_is_observed
    "policy.quiet_steps_ignore_cycles": "the steps that skip planning after plans that found nothing keep "
                                        "skipping after a cycle changed the acceptance estimates",
    # tests/replica/test_speculation_policy.py::test_a_plan_pays_for_the_rows_its_forward_pads
    "policy.riders_always_ride": "a step's target-only requests always ride in its verify forward, padded to "
                                 "the longest drafting request's rows, however few draft",
    # tests/replica/test_riders_apart.py::test_riders_apart_run_their_own_forward_and_decode_the_same_text
    "runner.riders_apart_ignored": "the runner ignores a plan's riders_apart and rides them in the verify "
                                   "forward the plan priced without them",
    # tests/replica/test_speculation_policy.py::test_a_run_of_accepted_blocks_is_drafted_in_whole_blocks
    "policy.acceptance_without_runs": "a request has one acceptance profile, whatever its last cycle accepted "
                                      "(a run's next block is forecast at the request's mean)",
    # tests/replica/test_speculation_policy.py::test_a_noisy_target_step_time_does_not_pick_the_drafting_steps
    "policy.target_cost_fast_decay": "the target-only cost line forgets as fast as the drafting lines (about "
                                     "ten steps), so a few slow steps select the moments a plan drafts",
    # tests/replica/test_speculation_policy.py::test_a_stalled_step_does_not_lift_the_cost_lines
    # tests/replica/test_speculation_policy.py::test_a_stalled_target_step_does_not_start_drafting_steps_that_lose
    "policy.cost_stalls_kept": "a step that stalled (tens of times its line's estimate) counts at its full "
                               "time, lifting the line for many steps",
    # tests/replica/test_speculation_policy.py::test_a_stalled_first_drafting_step_does_not_end_speculation
    "policy.first_drafting_step_trusted": "a drafting cost line's first steps are trusted however slow, and a "
                                          "probe is priced by them: one stalled first cycle ends drafting for good",
    # tests/replica/test_speculation_policy.py::test_a_lone_sampled_request_that_does_not_pay_is_planned_on_few_steps
    "policy.quiet_steps_need_many_requests": "quiet steps only at 4 or more requests, even when every "
                                             "candidate samples (a lone sampled request planned every step)",
    # tests/replica/test_gc_freeze.py
    "gc.not_frozen": "programs that load an engine leave its objects in the collector's generations "
                     "(every full collection walks them all: a 95-113 ms stall on a 2-core CPU)",
    # tests/replica/test_speculation_policy.py::test_requests_that_cannot_pay_until_a_cycle_have_long_quiet_stretches
    "policy.quiet_steps_uncertified": "no plan is certified unable to pay until a cycle: quiet stretches stay "
                                      "at most 4 steps",
    # tests/replica/test_speculation_policy.py::test_a_certified_quiet_stretch_holds_over_its_own_fades
    "policy.quiet_certificate_horizon_short": "the quiet-step certificate bounds the estimates by 4 fades while "
                                              "its stretch is 16 steps",
    "policy.quiet_certificate_ignores_fades": "the quiet-step certificate reads the requests' present estimates, "
                                              "not the best their fades toward the engine-wide ones could reach",
    # tests/replica/test_speculation_policy.py::test_requests_whose_stretch_cannot_pay_are_certified_though_the_engine_wide_profile_would
    "policy.quiet_certificate_past_the_stretch": "the quiet-step certificate bounds the estimates by every fade, "
                                                 "however many (the stretch is 16 steps): fewer stretches certified",
    # tests/replica/test_speculation_policy.py::test_quiet_steps_only_count_and_decide_as_the_bookkeeping_did
    "policy.quiet_steps_do_the_bookkeeping": "every quiet step runs the plan's bookkeeping (profiles, probe "
                                             "schedules, fades per request) instead of only counting",
    # tests/replica/test_speculation_policy.py::test_quiet_steps_known_from_the_roster_plan_as_the_full_plans_did
    "policy.quiet_shortcut_past_due_probes": "a quiet stretch known from the scheduler's roster goes on past a "
                                             "due probe (its requests are not probed until the stretch ends)",
    "policy.quiet_shortcut_skips_unjudged_probes": "a quiet stretch known from the scheduler's roster counts a due "
                                                   "probe as skipped before any plan found it unable to pay",
    # tests/replica/test_speculation_policy.py::test_a_request_that_stopped_drafting_drafts_again_when_its_evidence_fades
    "policy.idle_evidence_kept": "a request's own acceptance evidence keeps its weight while it decodes "
                                 "target-only, so a few failed cycles keep it from drafting until a probe",
    # tests/replica/test_speculation_policy.py::test_a_plan_pays_for_the_rows_its_forward_pads
    "policy.verify_cost_by_unpadded_rows": "the cost model prices a verify forward by the rows its requests "
                                           "verify only, not the padding of its grid (every request padded "
                                           "to the longest) that attention, the conv and the delta rule run on",
}

# Faults of the gRPC edge's responsiveness, each caught by the test named beside it.
EDGE_FAULTS: dict[str, str] = {
    # tests/cluster/test_edge_executors.py::test_admission_and_cancel_go_through_while_tokenization_fills_its_threads
    "servicer.shared_executor": "tokenization, admission and cancellation run in one executor, so a cancel or "
                                "an admission waits for every tokenize call queued before it",
    # tests/replica/test_tokenizer_gil.py::test_encoding_a_long_text_lets_other_threads_run
    "tokenizer.encode_holds_gil": "Tokenizer.encode calls tokenizers' plain encode, which holds the GIL for the "
                                  "whole call (a long text stalls the event loop and the engine thread)",
    # tests/cluster/test_registration.py::test_a_stream_cancelled_during_a_write_is_cancelled_inside_an_await
    "registration.stream_closed_at_yield": "server streams written as async generators are registered as they "
                                           "are: a call cancelled while gRPC writes a message leaves the "
                                           "generator at its yield (Ray Serve's proxy then never cancels "
                                           "the replica's call)",
    # tests/cluster/test_edge_executors.py::test_a_full_engine_refuses_while_a_step_holds_the_engine
    "servicer.admission_waits_for_engine": "a full engine's refusal is found only by engine.add_request (after an "
                                           "executor thread and the engine lock), not by the lock-free load check",
    # tests/cluster/test_launch.py::test_a_local_start_never_joins_the_cluster_ray_address_names
    "launch.local_start_joins_any_cluster": "a start without --address calls ray.init with no address, which joins "
                                            "the cluster RAY_ADDRESS or the last `ray start` names",
}

# Faults of the benchmarks' measurements, each caught by the test named beside it.
BENCH_FAULTS: dict[str, str] = {
    # tests/benchmarks/test_sweep.py::test_a_request_latency_runs_from_its_own_admission
    "bench.latency_from_load_start": "a request's latency in bench engine runs from its load's start, not from "
                                     "its own admission (a request that waited for a slot counts the wait)",
    # tests/benchmarks/test_paired.py::test_the_interval_covers_the_true_ratio_about_as_often_as_it_claims
    "bench.bootstrap_unpaired": "the bootstrap interval resamples the target-only and speculative sides apart, "
                                "so the machine's drift that pairing cancels widens the interval again",
    # tests/benchmarks/test_sweep.py::test_a_regime_with_a_length_spread_gives_each_request_its_own_length and
    # tests/benchmarks/test_sweep_server.py::test_a_served_regime_with_a_length_spread_streams_each_request_its_own_length
    "bench.request_lengths_fixed": "a regime's length spread is dropped: every request asks max_new_tokens, so a "
                                   "refilled load's target-only side finishes (and refills) all its slots at once",
}

_active: frozenset[str] = frozenset()


def active(name: str) -> bool:
    """True while a test has injected ``name``."""
    return name in _active


@contextmanager
def inject(*names: str) -> Iterator[None]:
    """Switch the named faults on for the duration of the block (tests only)."""
    global _active
    known = {**FAULTS, **MEMORY_FAULTS, **ENGINE_FAULTS, **EDGE_FAULTS, **BENCH_FAULTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"names: unknown fault(s) {unknown}; known: {sorted(known)}")
    before = _active
    _active = before | frozenset(names)
    try:
        yield
    finally:
        _active = before
