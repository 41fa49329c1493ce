"""The target's sampling distribution p: the one definition used everywhere.

Target-only decoding, speculative verification (``replica/verify.py``) and the
drafter tail's q over its candidates all build their distributions with
:func:`probabilities` below, so "the target distribution" means exactly this:

1. **temperature** ``T``: ``x = logits / T``. ``T == 0`` means greedy: only the
   argmax is kept (ties to the lower token id), whatever top-k / top-p say.
2. **min-p** ``m``: keep the entries with ``p_i >= m * max(p)`` (``p`` = softmax of
   ``x``), i.e. ``x_i >= max(x) + log(m)``; ``m == 0`` disables it.
3. **top-k** ``k``: keep the ``k`` largest entries of ``x``; ties at the
   boundary go to the lower token id, so exactly ``min(k, V)`` entries survive.
   ``k == 0`` disables it.
4. **top-p** ``P``: renormalise what top-k kept, sort it in descending order
   (ties by lower id) and keep the smallest prefix whose mass is ``>= P``. The
   top token is always kept; ``P == 1`` disables it (tokens are never dropped
   because a float64 cumulative sum happens to reach 1.0 early).

Dropped entries become ``-inf`` (:func:`filter_logits`) or probability 0
(:func:`probabilities`, ``softmax(filter_logits(...))`` computed in float64).
Each row needs at least one finite logit; NaN logits are undefined behaviour.

Randomness: every request owns one ``torch.Generator`` (:func:`make_generator`),
and callers pre-draw uniforms with :func:`draw_uniforms` and pass them down
(:func:`sample`, the tail chain, verification). A seeded request therefore
gets the same coins whatever else shares its batch, and a kernel and its
reference can be fed the same coins. Note: the same seed promises the same
*coins*, not the same text across hardware (logits differ in the last bits).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .request_rules import seed_problem

__all__ = [
    "SamplingParams",
    "batch_params",
    "batch_min_p",
    "filter_logits",
    "probabilities",
    "sample",
    "make_generator",
    "draw_uniforms",
]



def _is_int(value: object) -> bool:
    # bool is an Integral; a flag passed where a count belongs is a bug.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; validated on construction.

    Invalid values raise ``ValueError`` whose message starts with the field
    name, e.g. ``"temperature: must be finite and >= 0, got nan"``. Integral
    numbers are normalised to ``int``, real numbers to ``float`` and ``stop`` /
    ``stop_token_ids`` sequences to tuples, so instances hash and compare by value.
    """

    temperature: float = 0.0  # 0 = greedy (argmax, ties to lower id)
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # in (0, 1]; 1 = disabled
    seed: int | None = None  # None = nondeterministic generator
    max_new_tokens: int = 256  # >= 1
    stop: tuple[str, ...] = ()  # stop strings (not part of the output)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides EOS
    ignore_eos: bool = False  # keep generating past EOS
    # vLLM's names and ranges (replica/logits_processors.py applies them, in one place):
    min_p: float = 0.0  # in [0, 1]; keep tokens with p >= min_p * p_max (after temperature); 0 = off
    repetition_penalty: float = 1.0  # > 0; seen tokens (prompt + output): logit / r if > 0 else logit * r
    presence_penalty: float = 0.0  # in [-2, 2]; minus this once for every token the output already holds
    frequency_penalty: float = 0.0  # in [-2, 2]; minus this times the token's count in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    logprobs: int | None = None  # None = off; n in [0, 20]: chosen token's logprob + top-n alternatives
    # Seed-reproducible sampling (replica/gumbel.py): each token is the argmax of the filtered
    # log-probabilities plus Gumbel noise drawn from (seed, absolute position) only, so the same
    # seed gives the same tokens with speculation on or off and in any batch. Needs a seed.
    reproducible: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__

        t = self.temperature
        if not _is_real(t):
            raise ValueError(f"temperature: must be a real number, got {type(t).__name__} {t!r}")
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: must be finite and >= 0, got {t!r}")
        set_(self, "temperature", float(t))

        k = self.top_k
        if not _is_int(k):
            raise ValueError(f"top_k: must be an int, got {type(k).__name__} {k!r}")
        if k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 disables it), got {k!r}")
        set_(self, "top_k", int(k))

        p = self.top_p
        if not _is_real(p):
            raise ValueError(f"top_p: must be a real number, got {type(p).__name__} {p!r}")
        if not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1] (1 disables it), got {p!r}")
        set_(self, "top_p", float(p))

        s = self.seed
        if s is not None:
            if not _is_int(s):
                raise ValueError(f"seed: must be an int or None, got {type(s).__name__} {s!r}")
            if (problem := seed_problem(s)) is not None:
                raise ValueError(f"seed: {problem}")
            set_(self, "seed", int(s))

        m = self.max_new_tokens
        if not _is_int(m):
            raise ValueError(f"max_new_tokens: must be an int, got {type(m).__name__} {m!r}")
        if m < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {m!r}")
        set_(self, "max_new_tokens", int(m))

        stop = self.stop
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (tuple, list)):
            raise ValueError(f"stop: must be a tuple of strings, got {type(stop).__name__} {stop!r}")
        for item in stop:
            if not isinstance(item, str) or not item:
                raise ValueError(f"stop: entries must be non-empty strings, got {item!r}")
        set_(self, "stop", tuple(stop))

        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)):
            raise ValueError(f"stop_token_ids: must be a tuple of ints, got {type(ids).__name__} {ids!r}")
        for item in ids:
            if not _is_int(item) or item < 0:
                raise ValueError(f"stop_token_ids: entries must be ints >= 0, got {item!r}")
        set_(self, "stop_token_ids", tuple(int(i) for i in ids))

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {type(self.ignore_eos).__name__} {self.ignore_eos!r}")

        set_(self, "min_p", _real_in("min_p", self.min_p, 0.0, 1.0, "[0, 1] (0 disables it)"))
        r = _real_in("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "(0, inf) (1 disables it)")
        if r <= 0:
            raise ValueError(f"repetition_penalty: must be in (0, inf) (1 disables it), got {r!r}")
        set_(self, "repetition_penalty", r)
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, _real_in(name, getattr(self, name), -2.0, 2.0, "[-2, 2] (0 disables it)"))
        set_(self, "logit_bias", _logit_bias(self.logit_bias))

        n = self.logprobs
        if n is not None:
            if not _is_int(n):
                raise ValueError(f"logprobs: must be an int or None, got {type(n).__name__} {n!r}")
            if not 0 <= n <= MAX_LOGPROBS:
                raise ValueError(f"logprobs: must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {n!r}")
            set_(self, "logprobs", int(n))

        if not isinstance(self.reproducible, bool):
            raise ValueError(f"reproducible: must be a bool, got {type(self.reproducible).__name__} "
                             f"{self.reproducible!r}")
        if self.reproducible and self.seed is None:
            raise ValueError("reproducible: needs a seed (the noise is derived from the seed and the position)")

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax (temperature 0); top-k / top-p are then irrelevant."""
        return self.temperature == 0.0

    @property
    def is_gumbel(self) -> bool:
        """True when tokens are Gumbel-argmax draws (seed-reproducible mode at temperature > 0)."""
        return self.reproducible and not self.is_greedy


MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for
MAX_LOGIT_BIAS = 100.0  # |bias| bound, as OpenAI's API


def _real_in(name: str, value: object, low: float, high: float, allowed: str) -> float:
    if not _is_real(value):
        raise ValueError(f"{name}: must be a real number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or not low <= value <= high or (math.isinf(value)):
        raise ValueError(f"{name}: must be in {allowed}, got {value!r}")
    return float(value)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """Normalise a ``{token_id: bias}`` mapping or ``(id, bias)`` pairs to sorted pairs (ids checked
    against the vocabulary by the engine, which knows it)."""
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, (tuple, list)):
        items = list(bias)
    else:
        raise ValueError(f"logit_bias: must be a dict of token id -> bias, got {type(bias).__name__} {bias!r}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"logit_bias: entries must be (token id, bias) pairs, got {item!r}")
        token_id, value = item
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"logit_bias: token ids must be ints >= 0, got {token_id!r}")
        if not _is_real(value) or not math.isfinite(value) or abs(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: bias of token {token_id} must be finite in "
                             f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}")
        if int(token_id) in out:
            raise ValueError(f"logit_bias: token {token_id} appears twice")
        out[int(token_id)] = float(value)
    return tuple(sorted(out.items()))


def batch_min_p(params: Sequence[SamplingParams], device: torch.device | str | None = None) -> torch.Tensor:
    """``min_p [N]`` float64, one per request (0 = off)."""
    return torch.tensor([p.min_p for p in params], dtype=torch.float64, device=device)


def batch_params(
    params: Sequence[SamplingParams], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack per-request params into ``(temperature [N] f64, top_k [N] i64, top_p [N] f64)``."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    return temperature, top_k, top_p


def _row_param(value, n: int, dtype: torch.dtype, device: torch.device, name: str) -> torch.Tensor:
    t = torch.as_tensor(value, device=device).to(dtype)
    if t.dim() == 0:
        t = t.expand(n)
    if t.shape != (n,):
        raise ValueError(f"{name}: expected shape [{n}] (one per logits row), got {list(t.shape)}")
    return t


def _filter(logits: torch.Tensor, temperature, top_k, top_p, dtype: torch.dtype, min_p=0.0) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected shape [N, V], got {list(logits.shape)}")
    n, v = logits.shape
    dev = logits.device
    temperature = _row_param(temperature, n, dtype, dev, "temperature")
    top_k = _row_param(top_k, n, torch.int64, dev, "top_k")
    top_p = _row_param(top_p, n, dtype, dev, "top_p")
    if v == 0:
        raise ValueError("logits: vocabulary dimension is empty")

    greedy = temperature == 0
    # Shift by the row max first: softmax and the kept set are unchanged, and a
    # tiny temperature can then only push entries to -inf, never to +inf / NaN.
    x = logits.to(dtype)
    x = (x - x.amax(dim=-1, keepdim=True)) / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    min_p = _row_param(min_p, n, dtype, dev, "min_p")
    if bool((min_p > 0).any()):
        # min-p: keep p_i >= min_p * p_max. After the shift the top entry is 0, so p_i / p_max =
        # exp(x_i) and the test is x_i >= log(min_p), decided before top-k / top-p (it keeps a
        # prefix of the sorted order too, so it only ever narrows what they see).
        # (log 0 = -inf: a row with min_p 0 drops nothing; the top entry always survives)
        x = x.masked_fill(x < torch.log(min_p)[:, None], -math.inf)
    if bool(((top_k <= 0) | (top_k >= v) | greedy).all()) and bool(((top_p >= 1.0) | greedy).all()):
        return _keep_all_but_greedy(x, greedy)  # nothing truncates: skip the sort

    # One stable descending sort serves argmax, top-k and top-p: equal values
    # keep their original order, so ties always resolve to the lower token id.
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=dev)
    k = torch.where(top_k <= 0, torch.full_like(top_k, v), top_k.clamp(max=v))
    k = torch.where(greedy, torch.ones_like(k), k)
    keep_sorted = rank[None, :] < k[:, None]  # [N, V]

    # top-p over the top-k survivors (renormalised): keep entry i iff the mass
    # strictly before it is < top_p, i.e. the smallest prefix reaching top_p.
    probs_sorted = torch.softmax(sorted_x.masked_fill(~keep_sorted, -math.inf), dim=-1)
    csum = probs_sorted.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=-1)
    within_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep_sorted = keep_sorted & within_p  # rank 0 always survives: 0 < top_p

    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return x.masked_fill(~keep, -math.inf)


def _keep_all_but_greedy(x: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """The sorted path's result when no row truncates: greedy rows keep only their argmax."""
    if bool(greedy.any()):
        # argmax returns the first maximal index: ties go to the lower id, as in the sorted path
        argmax_only = torch.full_like(x, -math.inf).scatter_(-1, x.argmax(dim=-1, keepdim=True), 0.0)
        x = torch.where(greedy[:, None], argmax_only, x)
    return x


def filter_logits(logits: torch.Tensor, temperature, top_k, top_p, min_p=0.0) -> torch.Tensor:
    """Apply temperature, min-p, top-k, top-p; ``[N, V] -> [N, V]``, ``-inf`` outside the kept set.

    ``temperature`` [N] float, ``top_k`` [N] int, ``top_p`` [N] float (tensors, or
    scalars broadcast to every row). Kept entries hold
    ``(logits - rowmax) / temperature`` (the shift changes no softmax), so the top
    entry is 0; greedy rows (temperature 0) keep only their argmax, at 0. Computed
    in the logits' dtype, promoted to at least float32; ``softmax`` of the result
    is the target distribution (see :func:`probabilities` for the float64 one).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return _filter(logits, temperature, top_k, top_p, dtype, min_p)


def probabilities(logits: torch.Tensor, temperature, top_k, top_p, dtype: torch.dtype = torch.float64,
                  min_p=0.0) -> torch.Tensor:
    """The target distribution p: ``softmax(filter_logits(...))`` computed in ``dtype``; ``[N, V]``.

    Greedy rows are exactly one-hot on the argmax (ties to the lower id). The kept
    set (top-p boundary included) is decided in ``dtype`` too, so pass the same
    dtype everywhere p and q must agree (the default float64 does).
    """
    return torch.softmax(_filter(logits, temperature, top_k, top_p, dtype, min_p), dim=-1)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: ``probs [N, V]`` (non-negative, need not sum to 1), ``uniforms [N]`` in [0, 1).

    Returns ``ids [N]`` int64: the smallest ``i`` with ``cumsum(probs)[i] > u * sum(probs)``,
    so a zero-probability token is never returned (rounding at the top end falls
    back to the last positive entry). Rows summing to 0 are undefined (return 0).
    Deterministic given the uniforms; used by target-only sampling, the tail and
    verification so all of them read the same coins the same way.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs: expected shape [N, V], got {list(probs.shape)}")
    n, v = probs.shape
    if uniforms.shape != (n,):
        raise ValueError(f"uniforms: expected shape [{n}], got {list(uniforms.shape)}")
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype) * cdf[:, -1]
    ids = torch.searchsorted(cdf, target[:, None].contiguous(), right=True).squeeze(-1)
    # Last index with positive probability: guards u * total rounding up to total.
    positive = probs > 0
    last_pos = (v - 1) - torch.argmax(positive.flip(-1).to(torch.int8), dim=-1)
    return torch.minimum(ids, last_pos).to(torch.int64)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """One generator per request: seeded when ``seed`` is given, nondeterministic otherwise."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def draw_uniforms(
    generators: Sequence[torch.Generator], n: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[len(generators), n]`` float64 uniforms in [0, 1), row ``i`` from ``generators[i]``.

    One (cheap) draw per request: that is what makes a seeded request
    reproducible regardless of its batch. Callers should draw a fixed ``n`` per
    request per step (e.g. tail coins + accept coins + one resample coin), used
    or not, so the stream never depends on acceptance outcomes. Rows are moved
    to ``device`` (default: the first generator's device, or CPU when empty).
    """
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if not generators:
        return torch.empty(0, n, dtype=torch.float64, device=device or "cpu")
    rows = [torch.rand(n, generator=g, dtype=torch.float64, device=g.device) for g in generators]
    out_device = device if device is not None else rows[0].device
    return torch.stack([r.to(out_device) for r in rows])
