"""DSpineDrafter.forward_train (no pool, differentiable) equals the serving path append_context + draft."""
from __future__ import annotations

import pytest
import torch

from dspine.replica.draft_kv_pool import DraftKVPool
from dspine.replica.models.dspine_checkpoint import init_random_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.target_config import TargetArgs

TARGET = TargetArgs.from_name("tiny-qwen3")


def make(window: int, dtype: torch.dtype, block_size: int = 16, seed: int = 0):
    args = DraftArgs.for_target(TARGET, num_layers=2, window=window, feature_layers=(0, 1), block_size=block_size)
    return init_random_drafter(TARGET, args, seed=seed, dtype=dtype)


def data(d, B: int, L: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(B, L, d.args.num_features, d.args.hidden_size, generator=g, dtype=torch.float64).to(dtype)
    tokens = torch.randint(0, d.args.vocab_size, (B, L), generator=g)
    return feats, tokens


def pool_draft(d, feats, tokens, b: int, a: int, dtype):
    """The serving path for one block: context = positions < a of sequence b, anchor = tokens[b, a]."""
    pool = DraftKVPool(d.args, 64, dtype=dtype)
    pool.alloc_request("r")
    d.append_context(pool, ["r"], [feats[b, :a]])
    return d.draft(pool, ["r"], tokens[b, a : a + 1])


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("window", [3, 7, 64], ids=lambda w: f"window{w}")
def test_forward_train_equals_pool_path(dtype, tol, window):
    d = make(window, dtype)
    feats, tokens = data(d, B=2, L=24, seed=1, dtype=dtype)
    anchors = torch.tensor([[0, 5, 11, 23], [2, 9, 17, 20]])  # a = 0: empty context
    with torch.no_grad():
        train = d.forward_train(feats, tokens, anchors)
    BS, H = d.args.block_size, d.args.hidden_size
    assert train.hidden.shape == (2, 4, BS, H) and train.x_last.shape == (2, 4, BS, H)
    assert train.rms.shape == (2, 4, BS) and train.codes.shape == (2, 4, BS, d.args.code_dim)
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            ref = pool_draft(d, feats, tokens, b, a, dtype)
            for name in ("hidden", "x_last", "rms", "codes"):
                got, want = getattr(train, name)[b, i], getattr(ref, name)[0]
                torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol, msg=f"{name} b{b} a{a}")


def test_forward_train_small_block():
    """Block size 4 and a window smaller than the block (rows lose their own early block keys)."""
    d = make(window=2, dtype=torch.float64, block_size=4)
    feats, tokens = data(d, B=1, L=10, seed=2, dtype=torch.float64)
    anchors = torch.tensor([[1, 4, 9]])
    train = d.forward_train(feats, tokens, anchors)
    for i, a in enumerate(anchors[0].tolist()):
        ref = pool_draft(d, feats, tokens, 0, a, torch.float64)
        torch.testing.assert_close(train.hidden[0, i], ref.hidden[0], rtol=1e-10, atol=1e-10)


def test_forward_train_gradients_reach_drafter_only():
    d = make(window=16, dtype=torch.float32).train()
    d.embed_tokens.weight.requires_grad_(False)
    feats, tokens = data(d, B=2, L=20, seed=3, dtype=torch.float32)
    out = d.forward_train(feats, tokens, torch.tensor([[3, 4], [0, 1]]))
    loss = d.logits(out.hidden[:, :, 1:]).logsumexp(-1).mean() + out.codes[:, :, 1:].pow(2).mean()
    loss.backward()
    missing = [n for n, p in d.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []
    assert d.embed_tokens.weight.grad is None
    # nothing shared was registered as a drafter parameter
    assert all(p is not d.lm_head_weight for p in d.parameters())
