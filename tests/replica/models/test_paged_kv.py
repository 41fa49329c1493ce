"""The target's paged K/V pool: allocation discipline, same bits as the contiguous layout, and what a step moves."""
from __future__ import annotations

import pytest
import torch
from dspine_testing.models import make_target

from dspine import faults
from dspine.replica.models.paged_kv_pool import SINK_BLOCK, PagedKVPool, TargetKVPoolExhausted


def _pool(num_blocks=9, block_size=4):
    return PagedKVPool(num_layers=2, num_kv_heads=1, head_dim=4, num_blocks=num_blocks, block_size=block_size)


# ---------------------------------------------------------------- allocation
def test_blocks_are_reserved_all_or_nothing_and_the_sink_is_never_handed_out():
    pool = _pool()
    assert (pool.capacity_blocks, pool.num_free_blocks, pool.used) == (8, 8, 0)
    assert [pool.blocks_needed(n) for n in (0, 1, 4, 5, 16)] == [0, 1, 1, 2, 4]
    pool.alloc_request("a")
    pool.alloc_request("b")
    pool.reserve_many(["a", "b"], [9, 4])  # 3 + 1 blocks
    assert (pool.request_blocks("a"), pool.request_blocks("b"), pool.used) == (3, 1, 4)
    with pytest.raises(TargetKVPoolExhausted, match="5 blocks of 4 tokens requested, 4 free of 8"):
        pool.reserve_many(["a", "b"], [9 + 12, 4 + 8])  # 3 + 2 more, only 4 free
    assert pool.used == 4  # nothing taken
    table = pool.block_table(["a", "b"], width=4)
    assert SINK_BLOCK not in table[0, :3].tolist() and table[1, 1:].tolist() == [SINK_BLOCK] * 3
    assert len(set(table[0, :3].tolist()) | {table[1, 0].item()}) == 4  # no block shared
    with pytest.raises(ValueError, match="already holds"):
        pool.alloc_request("a")
    with pytest.raises(ValueError, match="no target KV blocks"):
        pool.reserve("zzz", 1)


def test_truncate_returns_whole_blocks_past_the_length_and_free_is_idempotent():
    pool = _pool()
    pool.alloc_request("a")
    pool.reserve("a", 14)  # 4 blocks
    first = pool.block_table(["a"])[0, :2].tolist()
    assert pool.truncate("a", 5) == 2 and pool.request_blocks("a") == 2  # position 4 is in block 1
    assert pool.block_table(["a"])[0].tolist() == first  # the kept blocks did not move
    assert pool.truncate("a", 8) == 0
    assert pool.free_request("a") == 2 and pool.used == 0 and pool.free_tokens == 8 * 4
    assert pool.free_request("a") == 0 and not pool.has_request("a")
    assert pool.peak == 4


def test_write_and_gather_address_positions_through_the_block_table():
    pool = _pool()
    pool.alloc_request("a")
    pool.reserve("a", 7)
    table = pool.block_table(["a"], width=2)
    slots = pool.slots(table, torch.arange(7)[None])  # [1, 7]
    rows = torch.arange(7 * 4, dtype=torch.float32).view(7, 1, 4)
    pool.write(1, slots[0], rows, -rows)
    k, v = pool.gather(1, slots)  # [1, Hkv, 7, D]
    assert torch.equal(k[0, 0], rows[:, 0]) and torch.equal(v[0, 0], -rows[:, 0])
    assert pool.k[0].abs().sum() == 0  # layer 0 untouched
    assert pool.bytes_written == 7 * pool.row_bytes and pool.bytes_gathered == 7 * pool.row_bytes


# ---------------------------------------------------------------- model
def _run_steps(model, states, generator, lens):
    """Prefill, then ragged verify-like steps with partial commits and single-token decodes;
    yields (rows, logits) of every step."""
    vocab = model.args.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in lens]
    out = model.forward_step(prompts, states)
    model.commit(states, lens)
    yield prompts, out.logits
    for it in range(3):
        rows = [torch.randint(0, vocab, (1 + (b * 3 + it) % 6,), generator=generator) for b in range(len(lens))]
        out = model.forward_step(rows, states)
        model.commit(states, [1 + (b + it) % len(r) for b, r in enumerate(rows)])  # some rejected rows
        yield rows, out.logits
        rows = [torch.randint(0, vocab, (1,), generator=generator) for _ in lens]
        out = model.forward_step(rows, states)
        model.commit(states, [1] * len(lens))
        yield rows, out.logits


LENGTHS = {1: [29], 3: [3, 17, 5], 8: [3, 17, 5, 29, 1, 11, 8, 23]}


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"], ids=["hybrid-gdn", "dense-qwen3"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_paged_logits_equal_contiguous_bit_for_bit(preset, batch):
    model = make_target(preset)
    pool = model.new_kv_pool(64, 16)
    lens = LENGTHS[batch]
    contiguous = [model.new_state() for _ in lens]
    paged = [model.new_state(kv_pool=pool, request_id=i) for i in range(batch)]
    steps_c = list(_run_steps(model, contiguous, torch.Generator().manual_seed(0), lens))
    steps_p = list(_run_steps(model, paged, torch.Generator().manual_seed(0), lens))
    for (rows, logits_c), (_, logits_p) in zip(steps_c, steps_p):
        for b, r in enumerate(rows):  # rows past a request's own count are padding, never used
            assert torch.equal(logits_c[b, : len(r)], logits_p[b, : len(r)])
    # after every commit each request holds exactly the blocks its committed length needs
    assert pool.used == sum(pool.blocks_needed(s.num_tokens) for s in paged)
    for s in paged:
        s.free()
    assert pool.used == 0


def test_an_off_by_one_slot_breaks_the_equality():
    """Power of the test above: rows stored one slot late change the logits."""
    model = make_target("tiny-qwen3")
    lens = LENGTHS[3]
    with faults.inject("paged_kv.slot_off_by_one"):
        pool = model.new_kv_pool(64, 16)
        paged = [model.new_state(kv_pool=pool, request_id=i) for i in range(3)]
        steps_p = list(_run_steps(model, paged, torch.Generator().manual_seed(0), lens))
    steps_c = list(_run_steps(model, [model.new_state() for _ in lens], torch.Generator().manual_seed(0), lens))
    assert any(not torch.equal(c[b, : len(r)], p[b, : len(r)])
               for (rows, c), (_, p) in zip(steps_c, steps_p) for b, r in enumerate(rows))


def _bytes_per_step(model, states, pool, lens):
    """Per step: (new rows, bytes written, bytes gathered, contiguous-layout copies)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    steps = _run_steps(model, states, gen, lens)
    while True:
        before = (pool.bytes_written, pool.bytes_gathered, model.kv_copy_bytes)
        try:
            rows, _ = next(steps)
        except StopIteration:
            return out
        out.append((sum(len(r) for r in rows), pool.bytes_written - before[0], pool.bytes_gathered - before[1],
                    model.kv_copy_bytes - before[2]))


@pytest.mark.parametrize("fault", [None, "paged_kv.write_padded_rows"])
def test_batch8_step_writes_only_the_new_rows(fault):
    model = make_target("tiny")
    num_full = len(model.args.full_layer_ids)
    pool = model.new_kv_pool(64, 16)
    paged = [model.new_state(kv_pool=pool, request_id=i) for i in range(8)]
    with faults.inject(*(f for f in [fault] if f)):
        counts = _bytes_per_step(model, paged, pool, LENGTHS[8])
    exact = all(written == new_rows * num_full * pool.row_bytes for new_rows, written, _, _ in counts)
    assert exact == (fault is None), counts
    # nothing sized by the batch's whole context was copied; the CPU gathers are transient and apart
    assert all(copied == 0 for *_, copied in counts)
    assert all(gathered > 0 for _, _, gathered, _ in counts)
    # the contiguous layout does copy (the counter is live)
    contiguous = [model.new_state() for _ in range(8)]
    copies = [c for *_, c in _bytes_per_step(model, contiguous, pool, LENGTHS[8])]
    assert all(c > 0 for c in copies)
    for s in paged:
        s.free()
