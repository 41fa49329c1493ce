"""Our target vs transformers' Qwen3_5ForCausalLM / Qwen3ForCausalLM on tiny random checkpoints (CPU, fp32)."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dspine.replica.models.loader import load_target  # noqa: E402
from dspine.replica.models.target import TargetModel  # noqa: E402

HYBRID_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def hf_model(kind: str, tie: bool = False):
    torch.manual_seed(0)
    common = dict(vocab_size=193, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie)
    if kind == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(
            num_hidden_layers=4, layer_types=HYBRID_TYPES, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            **common)
        model = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(num_hidden_layers=3, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0}, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # move every weight (norms included) away from its init value
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.15)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5-tied", "qwen3"])
def pair(request, tmp_path_factory):
    kind = request.param.split("-")[0]
    hf = hf_model(kind, tie=request.param.endswith("tied"))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_target(path)


def rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits.float()


def assert_states_close(s1, s2, tol=1e-5):
    """Same committed length and the same K/V, conv and recurrent state (relative RMS < tol)."""
    assert s1.num_tokens == s2.num_tokens and s1.num_pending == s2.num_pending == 0
    n = s1.num_tokens
    pairs = []
    if s1.k_cache is not None:
        pairs += [(s1.k_cache[:, :, :n], s2.k_cache[:, :, :n]), (s1.v_cache[:, :, :n], s2.v_cache[:, :, :n])]
    if s1.recurrent is not None:
        pairs += [(s1.conv_state, s2.conv_state), (s1.recurrent, s2.recurrent)]
    for x, y in pairs:
        assert x.shape == y.shape
        if y.abs().max() > 0:
            assert rel_rms(x, y) < tol
        else:
            assert x.abs().max() == 0


def test_full_prefill(pair):
    hf, ours = pair
    ids = torch.randint(0, 193, (2, 13))
    out = ours(ids)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, 13, 193)
    assert rel_rms(out.logits, hf_logits(hf, ids)) < 1e-4


def test_prefill_then_decode_token_by_token(pair):
    hf, ours = pair
    ids = torch.randint(0, 193, (1, 12))
    ref = hf_logits(hf, ids)[0]
    state = ours.new_state()
    got = [ours.forward_step(ids[:, :5], [state]).logits[0]]
    ours.commit([state], [5])
    for t in range(5, 12):
        got.append(ours.forward_step(ids[:, t : t + 1], [state]).logits[0])
        ours.commit([state], [1])
    assert state.num_tokens == 12
    assert rel_rms(torch.cat(got), ref) < 1e-4


def test_prefill_then_chunk(pair):
    hf, ours = pair
    ids = torch.randint(0, 193, (1, 14))
    ref = hf_logits(hf, ids)[0]
    state = ours.new_state()
    ours.forward_step(ids[:, :7], [state])
    ours.commit([state], [7])
    chunk = ours.forward_step(ids[:, 7:], [state]).logits[0]
    assert rel_rms(chunk, ref[7:]) < 1e-4


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_commit_prefix_equals_feeding_prefix(pair, k):
    hf, ours = pair
    ids = torch.randint(0, 193, (1, 15))
    # path A: prefill 5, chunk of 6, keep k, then continue with 4 fresh tokens
    a = ours.new_state()
    ours.forward_step(ids[:, :5], [a])
    ours.commit([a], [5])
    ours.forward_step(ids[:, 5:11], [a])
    ours.commit([a], [k])
    # path B: only the first 5 + k tokens ever fed
    b = ours.new_state()
    ours.forward_step(ids[:, : 5 + k], [b])
    ours.commit([b], [5 + k])
    assert_states_close(a, b)
    cont = torch.randint(0, 193, (1, 4))
    la = ours.forward_step(cont, [a]).logits[0]
    lb = ours.forward_step(cont, [b]).logits[0]
    full = torch.cat([ids[:, : 5 + k], cont], dim=1)
    assert rel_rms(la, hf_logits(hf, full)[0, 5 + k :]) < 1e-4
    assert rel_rms(la, lb) < 1e-5


def test_mixed_batch_equals_single(pair):
    """Different committed lengths and different numbers of new tokens in one call; commit per request."""
    hf, ours = pair
    torch.manual_seed(1)
    seqs = [torch.randint(0, 193, (n,)) for n in (9, 5, 11)]
    pre = [3, 4, 6]  # committed before the batched call
    keep = [2, 1, 0]
    states = [ours.new_state() for _ in seqs]
    for s, seq, p in zip(states, seqs, pre):
        ours.forward_step([seq[:p]], [s])
        ours.commit([s], [p])
    out = ours.forward_step([seq[p:] for seq, p in zip(seqs, pre)], states)
    assert out.num_new == [6, 1, 5]
    for b, (seq, p) in enumerate(zip(seqs, pre)):
        ref = hf_logits(hf, seq[None])[0, p:]
        assert rel_rms(out.logits[b, : len(seq) - p], ref) < 1e-4
    ours.commit(states, keep)
    for s, seq, p, k in zip(states, seqs, pre, keep):
        alone = ours.new_state()
        ours.forward_step([seq[: p + k]], [alone])
        ours.commit([alone], [p + k])
        assert_states_close(s, alone)


def test_feature_taps_match_hidden_states(pair):
    hf, ours = pair
    ids = torch.randint(0, 193, (2, 8))
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states
    n_layers = len(ours.layers)
    taps = tuple(range(n_layers - 1))  # HF's last entry is after the final norm
    state = [ours.new_state(), ours.new_state()]
    ours.forward_step(ids[:, :5], state)
    ours.commit(state, [5, 5])
    feats = torch.cat([ours(ids[:, :5], feature_layers=taps).features,
                       ours.forward_step(ids[:, 5:], state, feature_layers=taps).features], dim=1)
    assert feats.shape == (2, 8, len(taps), 64)
    for f, layer in enumerate(taps):
        assert rel_rms(feats[:, :, f], hidden[layer + 1]) < 1e-4


def test_bad_calls_raise(pair):
    _, ours = pair
    s = ours.new_state()
    with pytest.raises(ValueError, match="at least one new token"):
        ours.forward_step([torch.tensor([], dtype=torch.long)], [s])
    ours.forward_step(torch.tensor([[1, 2, 3]]), [s])
    with pytest.raises(ValueError, match="pending"):
        ours.forward_step(torch.tensor([[1]]), [s])
    with pytest.raises(ValueError, match="num_keep"):
        ours.commit([s], [4])
    ours.commit([s], [3])


def test_long_step_must_commit_in_full():
    args = TargetModel.from_name("tiny").args
    torch.manual_seed(0)
    model = TargetModel(dataclasses.replace(args, max_replay_tokens=4))
    s = model.new_state()
    model.forward_step(torch.randint(0, args.vocab_size, (1, 6)), [s])
    with pytest.raises(ValueError, match="committed in full"):
        model.commit([s], [3])
    model.commit([s], [6])
    assert s.num_tokens == 6


def test_long_prefill_chunked_form(pair):
    """T > 16 takes the chunked GDN form (two chunks here); logits still match, and so does the state."""
    hf, ours = pair
    ids = torch.randint(0, 193, (2, 70))
    assert rel_rms(ours(ids).logits, hf_logits(hf, ids)) < 1e-4
    chunked, stepped = ours.new_state(), ours.new_state()
    ours.forward_step(ids[:1], [chunked])
    ours.commit([chunked], [70])
    for c0 in range(0, 70, 10):
        ours.forward_step(ids[:1, c0 : c0 + 10], [stepped])
        ours.commit([stepped], [10])
    assert_states_close(chunked, stepped, tol=1e-4)


def test_chunked_delta_rule_equals_sequential():
    from dspine.replica.models.gated_deltanet import delta_rule_chunked, delta_rule_step

    torch.manual_seed(0)
    B, H, T, Dk, Dv = 2, 3, 37, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, T, Dk), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, Dv)
    g = -torch.rand(B, H, T) * 2
    beta = torch.rand(B, H, T)
    beta[1, :, 30:] = 0  # padded tail: no-op positions
    g[1, :, 30:] = 0
    s0 = torch.randn(B, H, Dk, Dv)
    out, final = delta_rule_chunked(q, k, v, g, beta, s0, chunk=16)
    state, ref = s0, []
    for t in range(T):
        state = delta_rule_step(state, k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
        ref.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    assert rel_rms(out, torch.stack(ref, dim=2)) < 1e-5
    assert rel_rms(final, state) < 1e-5
