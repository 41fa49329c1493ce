"""The model runner's step shape: target-only requests ride in a cycle's verify forward.

A step with a speculative cycle and target-only requests used to run two target forwards
(the verify over the drafting requests, then a one-row step over the rest); a forward's fixed
cost is most of a decode step's, so the runner now carries the target-only requests in the
verify forward with one row each. These tests count forwards and check the riders' output
against decoding them alone (greedy: the reference; sampled: the same seed alone)."""

from __future__ import annotations

import pytest
import torch

from dspine.replica import SamplingParams
from dspine.replica.reference import reference_generate

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _count_forwards(engine) -> list[int]:
    """Per engine step, the number of target forwards it ran (prefill steps included)."""
    counts = [0]
    forward_step = engine.target.forward_step

    def counted(*args, **kwargs):
        counts[-1] += 1
        return forward_step(*args, **kwargs)

    engine.target.forward_step = counted
    engine.add_step_observer(lambda record: counts.append(0))
    return counts


def _run(engine, prompts, params, speculative):
    ids = [engine.add_request(p, params, speculative=s) for p, s in zip(prompts, speculative)]
    out = {r: [] for r in ids}
    while engine.has_unfinished():
        for event in engine.step():
            out[event.request.request_id] += event.release.token_ids
    return [out[r] for r in ids]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_a_mixed_step_runs_one_target_forward(build, preset):
    target = build.target(preset)
    engine = build.engine(target)
    prompts = [_prompt(target.args.vocab_size, 3 + 4 * i, i) for i in range(6)]
    counts = _count_forwards(engine)
    outputs = _run(engine, prompts, GREEDY, speculative=[True, False, True, False, False, True])
    for prompt, output in zip(prompts, outputs):
        assert output == reference_generate(target, prompt, GREEDY.max_new_tokens)
    decode_steps = [c for c in counts[1:-1]]  # step 0 prefills all six (one forward)
    assert counts[0] == 1
    assert decode_steps and max(decode_steps) == 1, counts
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}


def test_riders_sample_as_they_would_alone(build, hybrid_target):
    """A sampled target-only request draws one coin per token from its own generator, riding or
    not, so with a seed its tokens equal the same request decoded alone."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.9, max_new_tokens=14, seed=7, ignore_eos=True)
    prompt = _prompt(512, 5, 1)
    alone = _run(build.engine(hybrid_target), [prompt], params, speculative=[False])[0]
    engine = build.engine(hybrid_target)
    counts = _count_forwards(engine)
    neighbours = [_prompt(512, 9, 2), _prompt(512, 4, 3)]
    outputs = _run(engine, [neighbours[0], prompt, neighbours[1]], params, speculative=[True, False, True])
    assert outputs[1] == alone
    assert max(counts[1:-1]) == 1


def test_a_rider_that_fails_is_ended_alone(build, hybrid_target):
    """A fault in a rider's target step (inside the verify forward) ends that request only."""
    engine = build.engine(hybrid_target)
    prompts = [_prompt(512, 4 + i, 10 + i) for i in range(3)]

    def fault_hook(stage, request_ids):
        if stage == "target_step" and "doomed" in request_ids:
            raise RuntimeError("injected failure in target_step")

    engine.runner.fault_hook = fault_hook
    engine.add_request(prompts[0], GREEDY, speculative=True, request_id="a")
    engine.add_request(prompts[1], GREEDY, speculative=False, request_id="doomed")
    engine.add_request(prompts[2], GREEDY, speculative=False, request_id="b")
    out, finish = {"a": [], "doomed": [], "b": []}, {}
    while engine.has_unfinished():
        for event in engine.step():
            out[event.request.request_id] += event.release.token_ids
            if event.release.status is not None:
                finish[event.request.request_id] = event.release.status.finish_reason
    assert finish == {"a": "length", "doomed": "error", "b": "length"}
    assert out["a"] == reference_generate(hybrid_target, prompts[0], GREEDY.max_new_tokens)
    assert out["b"] == reference_generate(hybrid_target, prompts[2], GREEDY.max_new_tokens)
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}
