"""Draft KV pool: allocation, free, exhaustion, the ring variant (and drafting through both)."""
from __future__ import annotations

import pytest
import torch

from dspine.replica.draft_kv_pool import PADDING_SLOT, DraftKVPool, DraftPoolExhausted, RingDraftKVPool
from dspine.replica.models.dspine_checkpoint import init_random_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.target_config import TargetArgs

ARGS = DraftArgs.from_name("tiny-b4")  # window 8, block 4


def test_alloc_append_free_and_counters():
    pool = DraftKVPool(ARGS, 11)  # capacity 10: slot 0 is the padding sink
    assert (pool.capacity, pool.used, pool.kv.shape) == (10, 0, (2, 2, 11, 1, 16))
    pool.alloc_request("a")
    pool.alloc_request("b")
    sa = pool.append("a", 3)
    sb = pool.append("b", 4)
    sa2 = pool.append("a", 2)
    all_slots = torch.cat([sa, sb, sa2]).tolist()
    assert PADDING_SLOT not in all_slots and len(set(all_slots)) == 9
    slots, lens = pool.context_slots(["a", "b"])
    assert lens.tolist() == [5, 4] and slots.shape == (2, 5)
    assert slots[0].tolist() == sa.tolist() + sa2.tolist() and slots[1, 4] == PADDING_SLOT
    assert pool.positions(["a", "b"]).tolist() == [5, 4] and pool.request_len("a") == 5
    assert (pool.used, pool.peak) == (9, 9)
    assert pool.free_request("a") == 5 and pool.used == 4 and pool.peak == 9
    assert pool.free_request("a") == 0  # idempotent (cancel after finish)
    pool.alloc_request("c")
    assert len(set(pool.append("c", 6).tolist()) & set(sb.tolist())) == 0


def test_exhaustion_is_typed_with_counts_and_try_later():
    pool = DraftKVPool(ARGS, 5)
    pool.alloc_request("a")
    pool.append("a", 3)
    assert pool.try_append("a", 2) is None  # try later
    with pytest.raises(DraftPoolExhausted, match="2 slots requested, 1 free of 4") as e:
        pool.append("a", 2)
    assert isinstance(e.value, RuntimeError) and (e.value.requested, e.value.free, e.value.capacity) == (2, 1, 4)
    pool.alloc_request("b")
    with pytest.raises(DraftPoolExhausted):
        pool.append_many(["a", "b"], [1, 1])
    assert pool.used == 3  # all or nothing


def test_misuse_is_value_error():
    pool = DraftKVPool(ARGS, 5)
    pool.alloc_request("a")
    with pytest.raises(ValueError, match="already"):
        pool.alloc_request("a")
    with pytest.raises(ValueError, match="alloc_request"):
        pool.append("zz", 1)
    with pytest.raises(ValueError):
        DraftKVPool(ARGS, 1)


def test_ring_holds_at_most_window_and_keeps_position_order():
    pool = RingDraftKVPool(ARGS, 40, window=5)
    pool.alloc_request("a")
    first = pool.append("a", 3).tolist()
    pool.append("a", 4)  # positions 3..6; 5, 6 reuse the slots of 0, 1
    assert pool.request_len("a") == 5 and pool.used == 5 and pool.num_positions("a") == 7
    slots, lens = pool.context_slots(["a"])
    assert lens.tolist() == [5]
    assert slots[0, -2:].tolist() == first[:2]  # positions 5, 6 sit where 0, 1 were
    big = pool.append("a", 12).tolist()  # more than the window in one call
    assert big[:7] == [PADDING_SLOT] * 7 and PADDING_SLOT not in big[7:]
    slots, lens = pool.context_slots(["a"])
    assert slots[0].tolist() == big[7:] and pool.used == 5
    assert pool.free_request("a") == 5 and pool.used == 0


def _drafter_and_features(seed=0):
    t = TargetArgs.from_name("tiny-qwen3")
    args = DraftArgs.from_name("tiny-b4", vocab_size=t.vocab_size, hidden_size=t.hidden_size)
    d = init_random_drafter(t, args, seed=seed)
    g = torch.Generator().manual_seed(1)
    return d, [torch.randn(n, args.num_features, args.hidden_size, generator=g) for n in (5, 3, 9)]


def test_ring_drafts_like_dense_inside_and_past_the_window():
    d, feats = _drafter_and_features()
    dense = DraftKVPool(d.args, 64)
    ring = RingDraftKVPool(d.args, 64)  # window 8
    for pool in (dense, ring):
        pool.alloc_request("r")
    anchor = torch.tensor([7])
    for f in feats:  # 5, then 8 (inside the window), then 17 positions (past it)
        for pool in (dense, ring):
            d.append_context(pool, ["r"], [f])
        a, b = d.draft(dense, ["r"], anchor), d.draft(ring, ["r"], anchor)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.codes, b.codes, rtol=1e-5, atol=1e-5)
    assert ring.request_len("r") == 8 and dense.request_len("r") == 17
