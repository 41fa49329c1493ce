"""A ragged forward_step computes its per-row work on the real rows only, with the same results."""
import pytest
import torch

from dspine import faults
from dspine.replica.models.row_packing import RowPacking
from dspine.replica.models.target import TargetArgs, TargetModel

pytestmark = pytest.mark.timeout(60)


def tiny_target() -> TargetModel:
    torch.manual_seed(0)
    args = TargetArgs(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=2,
                      num_kv_heads=1, head_dim=16,
                      layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
                      linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_num_key_heads=2, linear_num_value_heads=4)
    model = TargetModel(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def test_pack_and_pad_round_trip_in_row_major_order():
    lens = [3, 1, 2]
    valid = torch.arange(3)[None, :] < torch.tensor(lens)[:, None]
    packing = RowPacking(lens, valid)
    grid = torch.arange(9.0).reshape(3, 3, 1)
    packed = packing.pack(grid)
    assert packed.squeeze(1).tolist() == [0.0, 1.0, 2.0, 3.0, 6.0, 7.0]
    assert packing.pad(packed).squeeze(2).tolist() == [[0, 1, 2], [3, 0, 0], [6, 7, 0]]
    assert packing.last_rows(packed).squeeze(1).tolist() == [2.0, 3.0, 7.0]


def _rows_through_mlps(model, lens, pool):
    # a verify-like ragged step after a 6-token prefill; returns rows each MLP saw and the logits
    torch.manual_seed(1)
    states = [model.new_state(kv_pool=pool, request_id=f"r{i}") for i in range(len(lens))]
    with torch.inference_mode():
        model.forward_step([torch.randint(1, 97, (6,)) for _ in lens], states)
        model.commit(states, [6] * len(lens))
        seen = []
        hooks = [layer.mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
                 for layer in model.layers]
        try:
            out = model.forward_step([torch.randint(1, 97, (n,)) for n in lens], states, feature_layers=(1,))
        finally:
            for hook in hooks:
                hook.remove()
    return seen, out


@pytest.mark.parametrize("paged", [True, False])
def test_a_ragged_step_runs_its_mlps_on_the_real_rows_only(paged):
    """One request verifying 9 rows beside three riders: the MLPs see 12 rows, not 4 x 9 = 36.
    Fails with ``target.pad_rows_for_gemms`` (the padded grid through every GEMM)."""
    model = tiny_target()
    lens = [9, 1, 1, 1]
    pool = model.new_kv_pool(num_blocks=64, block_size=16) if paged else None
    seen, packed = _rows_through_mlps(model, lens, pool)
    assert seen == [sum(lens)] * len(model.layers)
    with faults.inject("target.pad_rows_for_gemms"):
        seen_padded, padded = _rows_through_mlps(model, lens, model.new_kv_pool(64, 16) if paged else None)
    assert seen_padded == [len(lens) * max(lens)] * len(model.layers)
    # the same logits and features on every real row either way; zeros on the packed step's padding
    for b, n in enumerate(lens):
        torch.testing.assert_close(packed.logits[b, :n], padded.logits[b, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(packed.features[b, :n], padded.features[b, :n], rtol=1e-4, atol=1e-5)
        assert bool((packed.logits[b, n:] == 0).all())
