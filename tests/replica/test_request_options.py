"""Request options at engine level: validation, penalties and logit bias inside verified blocks, min-p,
logprobs. (Seed-reproducible sampling: test_reproducible_sampling.py; sampled fits with penalties,
min-p and Gumbel mode: test_sampling_lossless.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from dspine_testing.distill import distilled_pair

from dspine import faults
from dspine.replica import Engine, EngineConfig, SamplingParams, sampling
from dspine.replica.errors import InvalidRequestError
from dspine.replica.logits_processors import context_counts, process
from dspine.replica.tail import Proposal


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


# ------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field, value", [
    ("min_p", float("nan")), ("min_p", -0.1), ("min_p", 1.5), ("min_p", "0.1"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("nan")),
    ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("presence_penalty", float("nan")), ("frequency_penalty", -2.01),
    ("frequency_penalty", True),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {3: float("nan")}), ("logit_bias", {3: 101.0}),
    ("logit_bias", {"a": 1.0}), ("logit_bias", 5),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", 2.0), ("logprobs", True),
    ("reproducible", 1),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**{field: value})


def test_reproducible_needs_a_seed_and_values_normalise():
    with pytest.raises(ValueError, match=r"^reproducible: needs a seed"):
        SamplingParams(temperature=1.0, reproducible=True)
    params = SamplingParams(logit_bias={5: 1, 2: -3.5}, logprobs=20, min_p=1, presence_penalty=-2)
    assert params.logit_bias == ((2, -3.5), (5, 1.0)) and params.min_p == 1.0 and params.presence_penalty == -2.0
    assert hash(params) == hash(SamplingParams(logit_bias=[(2, -3.5), (5, 1.0)], logprobs=20, min_p=1.0,
                                               presence_penalty=-2.0))


def test_engine_rejects_logit_bias_outside_the_vocabulary(build, hybrid_target):
    engine = build.engine(hybrid_target, with_drafter=False)
    vocab = hybrid_target.args.vocab_size
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert info.value.field == "logit_bias" and str(vocab) in str(info.value)
    assert engine.num_unfinished() == 0


# ------------------------------------------------------------------------------------------ min-p
def test_min_p_keeps_tokens_within_a_factor_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64))
    p = sampling.probabilities(logits, 1.0, 0, 1.0, min_p=torch.tensor([0.25, 0.9]))
    assert p[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])  # 0.05 < 0.25 * 0.5
    assert p[1].tolist() == pytest.approx([0.25] * 4)  # ties with the top all survive
    # after temperature: at T = 0.5, p ~ q^2: 0.09 / 0.25 = 0.36 >= 0.3 survives, 0.0225 / 0.25 does not
    p = sampling.probabilities(logits[:1], 0.5, 0, 1.0, min_p=0.3)
    assert (p[0] > 0).tolist() == [True, True, False, False]
    # greedy rows stay one-hot; min_p composes with top-k (the stricter wins)
    assert sampling.probabilities(logits[:1], 0.0, 0, 1.0, min_p=0.3)[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert (sampling.probabilities(logits[:1], 1.0, 1, 1.0, min_p=0.1)[0] > 0).sum() == 1


# ------------------------------------------------------------------------------------ penalties
def _naive_processed(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams):
    """Penalties of one position written out token by token (the definition, no tensor tricks)."""
    out = logits.double().clone()
    for token_id, bias in params.logit_bias:
        out[token_id] += bias
    for v in range(out.shape[0]):
        count = output.count(v)
        if v in prompt or count:
            r = params.repetition_penalty
            out[v] = out[v] / r if out[v] > 0 else out[v] * r
        out[v] -= params.presence_penalty * (count > 0) + params.frequency_penalty * count
    return out


PENALTIES = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, repetition_penalty=1.4,
                           presence_penalty=0.6, frequency_penalty=0.4, logit_bias={7: 3.0, 11: -5.0})


def test_block_rows_count_the_tokens_drafted_before_them():
    generator = torch.Generator().manual_seed(0)
    v, t = 12, 6
    logits = torch.randn(2, t, v, generator=generator)
    prompts, outputs = [[1, 2, 3], [4]], [[3, 5], [6, 6]]
    block = torch.tensor([[5, 9, 5, 0, 9], [1, 1, 2, 3, 4]])
    counts = context_counts(prompts, outputs, v, "cpu")
    params = [PENALTIES.__class__(**{**PENALTIES.__dict__, "logit_bias": {7: 3.0}}), PENALTIES]
    got = process(logits, params, counts, block)
    for b in range(2):
        for row in range(t):
            want = _naive_processed(logits[b, row], prompts[b], outputs[b] + block[b, :row].tolist(), params[b])
            torch.testing.assert_close(got[b, row].double(), want, atol=1e-5, rtol=1e-5)
    with faults.inject("penalties.same_counts_for_every_row"):
        broken = process(logits, params, counts, block)
    assert not torch.allclose(broken[:, 1:], got[:, 1:])


@torch.no_grad()
def _reference_with_penalties(target, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy target-only decoding recomputed from scratch each step, penalties applied naively."""
    output: list[int] = []
    for _ in range(params.max_new_tokens):
        logits = target(torch.tensor([prompt + output])).logits[0, -1]
        output.append(int(_naive_processed(logits, prompt, output, params).argmax()))
    return output


def _oracle(engine, truth: dict[tuple[int, ...], list[int]]):
    """Proposals that are the true continuation: every row verified and accepted, so row t's
    logits decide the token after y_1..y_t and a wrong count at any row changes the output."""
    num_draft = engine.block_size - 1

    def propose(request_ids, requests, draft_out, anchors, params, generators):
        rows = []
        for request_id in request_ids:
            request = requests[request_id]
            done = len(request.output_token_ids)
            continuation = truth[tuple(request.prompt_token_ids)]
            rows.append((continuation[done: done + num_draft] + [0] * num_draft)[:num_draft])
        draft_ids = torch.tensor(rows, dtype=torch.long)
        cand_ids = draft_ids[..., None].repeat(1, 1, engine.drafter.args.head_topk)
        q = torch.zeros(cand_ids.shape, dtype=torch.float64)
        q[..., 0] = 1.0
        return Proposal(draft_ids=draft_ids, q=q, cand_ids=cand_ids, choice=torch.zeros_like(draft_ids))

    engine.runner.propose = propose


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_with_penalties_identical_with_speculation_on_and_off(build, hybrid_target, batch):
    engine = build.engine(hybrid_target, window=8, max_concurrency=batch)
    prompts = _prompts(hybrid_target.args.vocab_size, [3, 17, 5, 29, 1, 11, 8, 23])
    truth = {tuple(p): _reference_with_penalties(hybrid_target, p, PENALTIES) for p in prompts}
    off = engine.generate_many(prompts, PENALTIES, speculative=False)
    assert [r.token_ids for r in off] == [truth[tuple(p)] for p in prompts]  # target-only = the definition
    _oracle(engine, {k: v + [0] * 40 for k, v in truth.items()})
    on = engine.generate_many(prompts, PENALTIES, speculative=True)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert all(r.stats.spec.num_accepted_tokens >= 15 for r in on)  # whole blocks were verified and accepted
    # penalties change the output (a test of a no-op would pass anything)
    plain = engine.generate_many(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
                                 speculative=False)
    assert [r.token_ids for r in plain] != [r.token_ids for r in off[:2]]


def test_one_penalty_vector_for_every_row_breaks_the_equivalence(build, hybrid_target):
    engine = build.engine(hybrid_target, window=8)
    prompts = _prompts(hybrid_target.args.vocab_size, [3, 17, 5])
    truth = {tuple(p): _reference_with_penalties(hybrid_target, p, PENALTIES) for p in prompts}
    _oracle(engine, {k: v + [0] * 40 for k, v in truth.items()})
    with faults.inject("penalties.same_counts_for_every_row"):
        on = engine.generate_many(prompts, PENALTIES, speculative=True)
    assert [r.token_ids for r in on] != [truth[tuple(p)] for p in prompts]


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_with_penalties_on_the_distilled_pair(batch):
    """The real draft path (partial acceptance, rejections mid-block) with penalties and a bias."""
    target, drafter = distilled_pair()
    engine = Engine(target, drafter, None, EngineConfig(device="cpu", dtype="float32", retrieval="exact",
                                                        adaptive_speculation=False, max_concurrency=batch))
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True, repetition_penalty=1.2,
                            frequency_penalty=0.3, logit_bias={5: 1.5})
    prompts = _prompts(64, [3, 17, 5, 29, 1, 11, 8, 23], seed=2)
    on = engine.generate_many(prompts, params, speculative=True)
    off = engine.generate_many(prompts, params, speculative=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    cycles = [(r.stats.spec.num_cycles, r.stats.spec.num_accepted_tokens) for r in on]
    assert sum(a for _, a in cycles) > sum(c for c, _ in cycles)  # more than one accepted row per cycle
    assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}


# ------------------------------------------------------------------------------------- logprobs
@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_a_direct_forward_and_agree_with_speculation_on_and_off(temperature):
    target, drafter = distilled_pair()
    engine = Engine(target, drafter, None, EngineConfig(device="cpu", dtype="float32", retrieval="exact",
                                                        adaptive_speculation=False))
    prompts = _prompts(64, [3, 12, 7], seed=4)
    params = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=24, ignore_eos=True, logprobs=5)
              for i in range(len(prompts))]
    on = engine.generate_many(prompts, params, speculative=True)
    off = engine.generate_many(prompts, params, speculative=False)
    scale = temperature if temperature > 0 else 1.0
    for prompt, result in zip(prompts, on):
        assert len(result.logprobs) == len(result.token_ids) == 24
        tokens = torch.tensor([prompt + result.token_ids])
        direct = torch.log_softmax(target(tokens).logits[0, len(prompt) - 1: -1].double() / scale, dim=-1)
        for i, entry in enumerate(result.logprobs):
            assert entry.token_id == result.token_ids[i]
            assert abs(entry.logprob - float(direct[i, entry.token_id])) < 1e-4
            top_values, top_ids = direct[i].topk(5)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert max(abs(a - float(b)) for (_, a), b in zip(entry.top, top_values)) < 1e-4
    if temperature == 0.0:
        for a, b in zip(on, off):
            assert a.token_ids == b.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
            assert all([t for t, _ in x.top] == [t for t, _ in y.top] for x, y in zip(a.logprobs, b.logprobs))
    assert on[0].stats.spec.num_accepted_tokens > 0


def test_logprobs_stream_with_each_chunk_and_follow_stop_rules(build, hybrid_target):
    engine = build.engine(hybrid_target, window=8)
    prompt = [3, 1, 4, 1, 5]
    full = engine.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2),
                           speculative=True)
    stop_at = full.token_ids[9]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2, stop_token_ids=(stop_at,))
    chunks = list(engine.stream(prompt, params, speculative=True))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    streamed = [e for c in chunks for e in c.logprobs]
    cut = full.token_ids.index(stop_at)
    assert [e.token_id for e in streamed] == full.token_ids[:cut]  # the stop token is neither text nor logprob
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in full.logprobs[:cut]], abs=1e-5)
    assert all(len(e.top) == 2 and e.top[0][1] >= e.top[1][1] for e in streamed)
    assert all(math.isfinite(e.logprob) and e.logprob <= 0 for e in streamed)
    plain = engine.generate(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), speculative=True)
    assert plain.logprobs is None
