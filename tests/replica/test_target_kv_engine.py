"""The engine with the target's paged K/V pool: same output as the contiguous layout, no leaks, new rows only."""
from __future__ import annotations

import pytest
import torch

from dspine import faults
from dspine.replica import SamplingParams
from dspine.replica.reference import reference_generate

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
LENGTHS = [3, 17, 5, 29, 1, 11, 8, 23]


def _prompts(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_default_pool_holds_every_request_at_its_largest(build, hybrid_target):
    engine = build.engine(hybrid_target, window=6, max_seq_len=40)
    pool = engine.runner.target_kv_pool
    assert pool is not None and pool.block_size == 16
    assert pool.capacity_blocks >= 8 * pool.blocks_needed(40 + engine.block_size)
    assert engine.runner.target_kv_free_tokens() == pool.capacity_blocks * 16
    assert build.engine(hybrid_target, target_kv_layout="contiguous").runner.target_kv_free_tokens() is None


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_batch8_paged_equals_contiguous_and_writes_only_new_rows(build, hybrid_target, speculative, monkeypatch):
    prompts = _prompts(hybrid_target.args.vocab_size, LENGTHS)
    target, forward = hybrid_target, hybrid_target.forward_step
    results = {}
    for layout in ("contiguous", "paged"):
        engine = build.engine(hybrid_target, window=6, target_kv_layout=layout)
        pool = engine.runner.target_kv_pool
        steps = []  # (new rows, K/V bytes written, bytes gathered, contiguous-layout copies) per forward_step

        def counted(rows, states, feature_layers=(), _pool=pool, _steps=steps, **kwargs):
            before = (_pool.bytes_written, _pool.bytes_gathered, target.kv_copy_bytes) if _pool else None
            out = forward(rows, states, feature_layers, **kwargs)
            if _pool is not None:
                _steps.append((sum(out.num_new), _pool.bytes_written - before[0],
                               _pool.bytes_gathered - before[1], target.kv_copy_bytes - before[2]))
            return out

        monkeypatch.setattr(target, "forward_step", counted, raising=False)
        results[layout] = [r.token_ids for r in engine.generate_many(prompts, GREEDY, speculative=speculative)]
        assert engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0,
                                            "target_kv_blocks": 0}
        if layout == "paged":
            row_bytes = len(target.args.full_layer_ids) * pool.row_bytes
            assert steps and all(written == rows * row_bytes for rows, written, _, _ in steps), steps
            assert all(copied == 0 for *_, copied in steps)
            batch8 = [s for s in steps if s[0] >= 8]
            assert batch8 and all(gathered > written for _, written, gathered, _ in batch8)
    assert results["paged"] == results["contiguous"]
    assert results["paged"][:2] == [reference_generate(hybrid_target, p, GREEDY.max_new_tokens) for p in prompts[:2]]


@pytest.mark.parametrize("fault", [None, "paged_kv.free_keeps_blocks"])
def test_cancel_and_finish_return_every_block(build, hybrid_target, fault):
    engine = build.engine(hybrid_target)
    prompts = _prompts(hybrid_target.args.vocab_size, LENGTHS[:4])
    with faults.inject(*(f for f in [fault] if f)):
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        engine.step()
        engine.step()
        assert engine.num_live_states()["target_kv_blocks"] > 0
        engine.cancel(ids[1])
        while engine.has_unfinished():
            engine.step()
    assert (engine.num_live_states()["target_kv_blocks"] == 0) == (fault is None)


def test_a_request_the_pool_cannot_hold_is_refused_naming_the_pool(build, hybrid_target):
    """Admission by memory reads the pool itself: a request it can never hold is refused when added,
    naming the target K/V; a full pool's last resort (an exhausted reserve mid-step) is never hit."""
    from dspine.replica.errors import RequestTooLargeError

    engine = build.engine(hybrid_target, target_kv_blocks=4)  # 3 blocks of 16 tokens
    small, big = _prompts(hybrid_target.args.vocab_size, [5, 60])
    small_id = engine.add_request(small, GREEDY, speculative=False)  # 5 + 20 (+ 15 verify rows) -> 3 blocks
    with pytest.raises(RequestTooLargeError, match="target K/V can never hold"):
        engine.add_request(big, GREEDY, speculative=False)
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert not any(e.request.error for e in events)
    assert [t for e in events if e.request.request_id == small_id for t in e.release.token_ids] == \
        reference_generate(hybrid_target, small, GREEDY.max_new_tokens)
    assert engine.num_live_states()["target_kv_blocks"] == 0


@pytest.mark.parametrize("field,value", [("target_kv_layout", "pages"), ("target_kv_block_size", 0),
                                         ("target_kv_blocks", 1)])
def test_bad_kv_settings_name_the_field(field, value):
    from dspine.replica import EngineConfig

    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**{field: value})
