"""Semantics of the target distribution p (dspine.replica.sampling)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspine.replica.sampling import (
    SamplingParams,
    batch_params,
    draw_uniforms,
    filter_logits,
    make_generator,
    probabilities,
    sample,
)

def kept(logits, temperature, top_k, top_p):
    """Kept token ids of a single row, as a sorted list."""
    out = filter_logits(torch.tensor([logits], dtype=torch.float64), [temperature], [top_k], [top_p])
    return torch.nonzero(torch.isfinite(out[0])).flatten().tolist()


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": None}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": False}, "seed"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 3.0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"stop": "abc"}, "stop"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop": (1,)}, "stop"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
        ({"stop_token_ids": (True,)}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else x,
)
def test_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_params_message_format():
    with pytest.raises(ValueError, match=r"^temperature: must be finite and >= 0, got nan$"):
        SamplingParams(temperature=float("nan"))


def test_params_defaults_normalisation_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_new_tokens) == (0.0, 0, 1.0, None, 256)
    assert p.is_greedy
    q = SamplingParams(temperature=1, top_k=np.int64(5), top_p=1, seed=7, stop=["x"], stop_token_ids=[3])
    assert isinstance(q.temperature, float) and isinstance(q.top_k, int) and isinstance(q.top_p, float)
    assert q.stop == ("x",) and q.stop_token_ids == (3,)
    assert not q.is_greedy
    same = SamplingParams(temperature=1.0, top_k=5, top_p=1.0, seed=7, stop=("x",), stop_token_ids=(3,))
    assert q == same and hash(q) == hash(same)
    with pytest.raises(AttributeError):
        q.temperature = 0.5  # frozen
    t, k, pp = batch_params([p, q])
    assert t.tolist() == [0.0, 1.0] and k.tolist() == [0, 5] and pp.tolist() == [1.0, 1.0]
    assert (t.dtype, k.dtype, pp.dtype) == (torch.float64, torch.int64, torch.float64)


# --------------------------------------------------------------------------- filter / probabilities


def test_greedy_keeps_argmax_ties_to_lower_id():
    assert kept([1.0, 3.0, 3.0, 2.0], 0.0, 0, 1.0) == [1]
    # top-k / top-p do not matter for greedy rows
    assert kept([1.0, 3.0, 3.0, 2.0], 0.0, 3, 0.2) == [1]
    p = probabilities(torch.tensor([[5.0, 1.0, 5.0]]), [0.0], [0], [1.0])
    assert p.tolist() == [[1.0, 0.0, 0.0]] and p.dtype == torch.float64


def test_top_k_ties_go_to_lower_id():
    assert kept([1.0, 3.0, 3.0, 2.0], 1.0, 2, 1.0) == [1, 2]
    assert kept([3.0, 1.0, 3.0, 3.0], 1.0, 2, 1.0) == [0, 2]
    assert kept([3.0, 1.0, 3.0, 3.0], 1.0, 1, 1.0) == [0]
    assert kept([0.0, 0.0, 0.0], 1.0, 0, 1.0) == [0, 1, 2]  # disabled
    assert kept([0.0, 0.0, 0.0], 1.0, 10, 1.0) == [0, 1, 2]  # k > V


def test_top_p_smallest_prefix():
    logits = np.log([0.5, 0.3, 0.2]).tolist()
    assert kept(logits, 1.0, 0, 0.45) == [0]
    assert kept(logits, 1.0, 0, 0.6) == [0, 1]
    assert kept(logits, 1.0, 0, 0.85) == [0, 1, 2]
    assert kept(logits, 1.0, 0, 1e-9) == [0]  # top token always kept
    # ties inside the sorted order: lower id first
    assert kept([1.0, 2.0, 2.0, 0.0], 1.0, 0, 0.3) == [1]


def test_top_p_one_never_drops_tokens():
    logits = [0.0] + [-40.0] * 5  # float64 cumulative mass reaches 1.0 at the first token
    assert kept(logits, 1.0, 0, 1.0) == list(range(6))
    assert kept(logits, 1.0, 0, 0.999) == [0]


def test_order_temperature_then_top_k_then_top_p():
    # temperature first: a sharper distribution reaches top_p sooner
    assert kept([2.0, 1.0, 0.0], 1.0, 0, 0.7) == [0, 1]
    assert kept([2.0, 1.0, 0.0], 0.25, 0, 0.7) == [0]
    # top-p reads the distribution renormalised over the top-k survivors:
    # [0.4, 0.3] -> [4/7, 3/7]; the mass before token 1 is 0.571 >= 0.55.
    logits = np.log([0.4, 0.3, 0.2, 0.1]).tolist()
    assert kept(logits, 1.0, 0, 0.55) == [0, 1]
    assert kept(logits, 1.0, 2, 0.55) == [0]


def test_values_and_probabilities_match_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0]], dtype=torch.float64)
    out = filter_logits(logits, [2.0], [3], [1.0])
    assert torch.equal(torch.isinf(out), torch.tensor([[False, False, False, True]]))
    torch.testing.assert_close(out[0, :3], (logits[0, :3] - 2.0) / 2.0)
    p = probabilities(logits, [2.0], [3], [1.0])
    e = torch.exp(logits[0, :3] / 2.0)
    torch.testing.assert_close(p[0], torch.cat([e / e.sum(), torch.zeros(1, dtype=torch.float64)]))
    # filter_logits keeps float32 inputs in float32, probabilities defaults to float64
    assert filter_logits(logits.float(), [1.0], [0], [1.0]).dtype == torch.float32
    assert filter_logits(logits.half(), [1.0], [0], [1.0]).dtype == torch.float32
    assert probabilities(logits.float(), [1.0], [0], [1.0], dtype=torch.float32).dtype == torch.float32


def test_tiny_temperature_and_inf_logits_stay_finite():
    p = probabilities(torch.tensor([[1000.0, 999.0, -math.inf]]), [1e-300], [0], [1.0])
    assert p.tolist() == [[1.0, 0.0, 0.0]]


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^top_k:"):
        filter_logits(torch.zeros(2, 3), torch.ones(2), torch.zeros(3, dtype=torch.int64), torch.ones(2))
    with pytest.raises(ValueError, match=r"^logits:"):
        filter_logits(torch.zeros(3), torch.ones(1), torch.zeros(1), torch.ones(1))


def _reference_probs(logits, t, k, p):
    """Slow per-row oracle of the documented semantics, in float64 numpy."""
    v = len(logits)
    order = sorted(range(v), key=lambda i: (-logits[i], i))
    if t == 0:
        keep = {order[0]}
        return np.array([1.0 if i in keep else 0.0 for i in range(v)])
    keep = order[: (min(k, v) if k > 0 else v)]
    x = np.array([logits[i] / t for i in keep])
    w = np.exp(x - x.max())
    w = w / w.sum()
    if p < 1.0:
        mass, cut = 0.0, []
        for i, wi in zip(keep, w):
            if mass >= p:
                break
            cut.append(i)
            mass += wi
        keep = cut
    out = np.zeros(v)
    x = np.array([logits[i] / t for i in keep])
    w = np.exp(x - x.max())
    out[keep] = w / w.sum()
    return out


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(-3, 3), min_size=7, max_size=7),  # integer logits: many ties
            st.sampled_from([0.0, 0.5, 1.0, 1.7]),
            st.integers(0, 9),
            st.sampled_from([0.05, 0.3, 0.5, 0.77, 0.9, 1.0]),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_batched_matches_per_row_reference(rows):
    logits = torch.tensor([r[0] for r in rows], dtype=torch.float64) * 0.731
    t = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    k = torch.tensor([r[2] for r in rows])
    p = torch.tensor([r[3] for r in rows], dtype=torch.float64)
    got = probabilities(logits, t, k, p)
    for i, (_, ti, ki, pi) in enumerate(rows):
        want = _reference_probs(logits[i].tolist(), ti, ki, pi)
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-12, atol=1e-15)
        # same kept set from filter_logits
        assert torch.equal(torch.isfinite(filter_logits(logits, t, k, p)[i]), torch.from_numpy(want > 0))


# --------------------------------------------------------------------------- sample / generators


def test_sample_inverse_cdf():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]] * 5, dtype=torch.float64)
    u = torch.tensor([0.0, 0.19, 0.2, 0.69, 1 - 2**-53], dtype=torch.float64)
    assert sample(probs, u).tolist() == [0, 0, 2, 2, 3]
    # unnormalised rows, zero-probability tail never chosen
    probs = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]], dtype=torch.float64)
    u = torch.tensor([1 - 2**-53, 0.5], dtype=torch.float64)
    assert sample(probs, u).tolist() == [1, 2]
    assert sample(probs, u).dtype == torch.int64


def test_seeded_generators_reproducible_regardless_of_batch():
    a = draw_uniforms([make_generator(123)], 5)
    b = draw_uniforms([make_generator(7), make_generator(123), make_generator(None)], 5)
    assert a.shape == (1, 5) and b.shape == (3, 5) and a.dtype == torch.float64
    assert torch.equal(a[0], b[1])
    assert not torch.equal(b[0], b[1])
    assert ((b >= 0) & (b < 1)).all()
    assert draw_uniforms([], 4).shape == (0, 4)
    # the same seed gives the same sampled tokens
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    probs = probabilities(logits, [0.9], [20], [0.9])
    draws = [sample(probs.expand(8, -1), draw_uniforms([make_generator(99)], 8)[0]) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
