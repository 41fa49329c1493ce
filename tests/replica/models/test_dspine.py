"""DSpine drafter: causality, window, batch isolation, shared head, checkpoint round trip."""
from __future__ import annotations

import json

import pytest
import torch

from dspine.replica.draft_kv_pool import DraftKVPool
from dspine.replica.models.dspine import DSpineDrafter
from dspine.replica.models.dspine_checkpoint import init_random_drafter, load_drafter, save_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.target_config import TargetArgs

TARGET = TargetArgs.from_name("tiny-qwen3")


def make(window=64, dtype=torch.float64, seed=0):
    args = DraftArgs.for_target(TARGET, num_layers=2, window=window, feature_layers=(0, 1))
    d = init_random_drafter(TARGET, args, seed=seed, dtype=dtype)
    return d


def feats(d, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d.args.num_features, d.args.hidden_size, generator=g, dtype=torch.float64)


def pool_with(d, contexts: dict, num_slots=256):
    pool = DraftKVPool(d.args, num_slots, dtype=torch.float64)
    for rid, f in contexts.items():
        pool.alloc_request(rid)
        d.append_context(pool, [rid], [f])
    return pool


@pytest.mark.parametrize("t", [0, 5, 14], ids=lambda t: f"t{t}")
def test_rows_are_causal(t):
    """Changing the inputs of rows t+1..15 leaves rows 0..t unchanged (hidden, x_last, codes, rms)."""
    d = make()
    pool = pool_with(d, {"a": feats(d, 11, 1)})
    anchor = torch.tensor([3])
    x = d.block_inputs(anchor)
    with torch.no_grad():
        a = d.forward_block(pool, ["a"], anchor, x)
        x2 = x.clone()
        x2[:, t + 1:] += torch.randn_like(x2[:, t + 1:])
        b = d.forward_block(pool, ["a"], anchor, x2)
    for name in ("hidden", "x_last", "codes", "rms"):
        u, v = getattr(a, name), getattr(b, name)
        assert torch.equal(u[:, : t + 1], v[:, : t + 1]), name
        assert not torch.equal(u[:, t + 1:], v[:, t + 1:]), name


def test_context_outside_window_has_no_effect():
    d = make(window=6)
    ctx = feats(d, 20, 2)
    pool = pool_with(d, {"a": ctx})
    anchor = torch.tensor([9])
    a = d.draft(pool, ["a"], anchor)
    slots, _ = pool.context_slots(["a"])
    # positions <= 20 - 6 = 14 are outside every row's window (row r sees p > 20 + r - 6)
    pool.kv[:, :, slots[0, :15]] = 1e3
    b = d.draft(pool, ["a"], anchor)
    assert torch.equal(a.hidden, b.hidden)
    pool.kv[:, :, slots[0, 15]] = 1e3  # position 15 is inside row 0's window
    c = d.draft(pool, ["a"], anchor)
    assert not torch.allclose(a.hidden[:, 0], c.hidden[:, 0])


def test_batch_isolation_different_context_lengths():
    d = make()
    fa, fb = feats(d, 3, 3), feats(d, 17, 4)
    together = pool_with(d, {})
    for rid in ("a", "b"):
        together.alloc_request(rid)
    d.append_context(together, ["a", "b"], [fa, fb])
    both = d.draft(together, ["a", "b"], torch.tensor([5, 6]), compute_logits=True)
    for i, (rid, f, tok) in enumerate((("a", fa, 5), ("b", fb, 6))):
        alone = d.draft(pool_with(d, {rid: f}), [rid], torch.tensor([tok]), compute_logits=True)
        for name in ("hidden", "x_last", "codes", "rms", "logits"):
            torch.testing.assert_close(getattr(both, name)[i: i + 1], getattr(alone, name), rtol=1e-10, atol=1e-10)


def test_incremental_context_equals_one_shot():
    """Appending 7 then 5 positions gives the same K/V (RoPE at absolute positions) as 12 at once."""
    d = make()
    f = feats(d, 12, 5)
    one = pool_with(d, {"a": f})
    two = pool_with(d, {"a": f[:7]})
    d.append_context(two, ["a"], [f[7:]])
    anchor = torch.tensor([1])
    torch.testing.assert_close(d.draft(one, ["a"], anchor).hidden, d.draft(two, ["a"], anchor).hidden)


def test_empty_context_and_anchor_row_inputs():
    d = make()
    pool = pool_with(d, {"a": feats(d, 0, 0)})
    out = d.draft(pool, ["a"], torch.tensor([4]))
    assert out.hidden.shape == (1, d.args.block_size, d.args.hidden_size) and torch.isfinite(out.hidden).all()
    x = d.block_inputs(torch.tensor([4, 8]))
    assert torch.equal(x[1, 0], d.embed_tokens.weight[8].to(x.dtype))
    assert torch.equal(x[0, 1], d.mask_embedding) and torch.equal(x[1, 15], d.mask_embedding)


def test_shared_head_is_a_reference_not_a_parameter():
    embed = torch.nn.Embedding(TARGET.vocab_size, TARGET.hidden_size)
    head = torch.randn(TARGET.vocab_size, TARGET.hidden_size)
    args = DraftArgs.for_target(TARGET, num_layers=1)
    d = init_random_drafter(type("T", (), {"embed_tokens": embed, "lm_head_weight": head, "args": TARGET})(), args)
    assert d.lm_head_weight is head and d.embed_tokens is embed
    names = set(d.state_dict())
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert all(p is not head for p in d.parameters())
    assert {"bridge.codebook", "bridge.read_proj.0", "bridge.write_proj.0", "norm.weight"} <= names
    with pytest.raises(ValueError, match="lm_head_weight"):
        DSpineDrafter(args, embed, head[:, :3])


def test_checkpoint_round_trip_gives_identical_drafts(tmp_path):
    d = make(dtype=torch.float32)
    path = save_drafter(d, tmp_path / "draft")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "dspine" and cfg["window"] == 64
    loaded = load_drafter(path, d.embed_tokens, d.lm_head_weight, device="cpu", dtype=torch.float32)
    assert loaded.args == d.args and loaded.lm_head_weight is d.lm_head_weight
    f = feats(d, 9, 6).float()
    outs = []
    for m in (d, loaded):
        pool = DraftKVPool(m.args, 32)
        pool.alloc_request("a")
        m.append_context(pool, ["a"], [f])
        outs.append(m.draft(pool, ["a"], torch.tensor([2]), compute_logits=True))
    for name in ("hidden", "x_last", "codes", "rms", "logits"):
        assert torch.equal(getattr(outs[0], name), getattr(outs[1], name)), name


def test_saving_the_same_drafter_writes_the_same_bytes(tmp_path):
    # A rebuilt drafter is compared with the shipped one file to file, so a save must be a pure
    # function of the weights (a header with several metadata keys came out in varying order).
    d = make(dtype=torch.float32)
    files = {(save_drafter(d, tmp_path / f"d{i}") / "model.safetensors").read_bytes() for i in range(8)}
    assert len(files) == 1
