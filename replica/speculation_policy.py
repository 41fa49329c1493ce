"""Adaptive speculation: per step and per request, how many draft rows to verify, or none.

Speculation pays only where the tokens a cycle is expected to commit outweigh
what the draft, tail, commit and the wider verify forward cost over a plain
target step. Both sides are measured, not assumed:

* :class:`CostModel` learns, online and on the machine it runs on, the target
  forward's seconds as a line in the rows it carries (a target-only step over
  B requests is B rows; a verify computes its real rows, and a share of the padding
  of its grid, every request padded to the longest one's rows)
  and the draft + tail + commit overhead as a line in the rows drafted (each
  drafting request's block is the anchor plus the longest plan's rows).
  Observations decay, so the model follows a machine whose speed drifts.
* :class:`AcceptanceProfile` keeps, per request, the decayed probability that
  row t is accepted given rows 1..t-1 were, from that request's past cycles
  (new requests start from the engine-wide profile of their kind: greedy and
  sampled requests accept very differently, so each kind has its own), one
  profile for the cycle after a block accepted in full and one for any other
  (acceptance comes in runs). A request's own evidence fades while it decodes
  target-only (its failed cycles say little about the text a few tokens on), so it
  leans on the engine-wide profile again and drafts when that says it pays.

:class:`SpeculationPolicy.plan` then picks the plan with the most expected
tokens per second (row t of request b gains ``P(rows 1..t of b accepted)``
tokens, scaled by what the kind's planned cycles accepted against their
forecasts; each request verifies its own number of rows, and the verify forward
costs the rows it verifies plus a share of its grid's padding, every request of
the step padded to the longest one's rows, or the riders run a target-only
forward of their own when that is cheaper), and compares it with a target-only
step. When
target-only wins, a probe step drafts again after a while (4 steps, doubling
up to 64 while speculation keeps losing; 256 for sampled requests, each kind
and batch size on its own schedule) so a request whose text becomes
predictable is noticed. The back-off starts over only after a planned drafting
step that paid (one that committed at least the tokens a target-only step would
have in its time), and only at that step's batch size. A probe's lucky cycle lifts the
estimates and the next step drafts; if that step does not pay, the probes keep
backing off (restarting them at 4 put five probes into 128 steps of 8 requests
in flight, each 2.8 target-only steps long for 2 steps' tokens).

Where freed slots stay empty (a closed group of requests, a load's last ones), a
token is priced by what it saves of the batch's remaining decode time, not at a
loaded replica's full rate (``replica/drain_pricing.py``, the share of freed slots
refilled measured by ``replica/slot_refills.py``): running one request ahead of
the others buys them a thinner, dearer batch later. Probes follow the same
prices: a probe that could not pay even if every row were accepted is not made.
After plans that found nothing to draft for the same requests, with no cycle
observed since, the next steps (1, 2, up to 4 in a row; 16 once a plan over the
best estimates their fades could reach finds nothing either) are not planned, and
most of them only count. The cost lines read a stalled step (a collection, the OS)
as three times their estimate, not its full time.

Lossless by construction: a plan is made before the step drafts anything,
from past cycles and timings only, so whether a row is verified never depends
on the token drawn at that row (the tail's confidence cut, applied on top,
obeys the same rule; see ``tail.chain_confidence``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
import operator
from bisect import bisect_left
from itertools import accumulate

from dspine import faults

from .drain_pricing import DrainPricing, drain_pricing, shortest_runs

__all__ = ["LinearCost", "CostModel", "AcceptanceProfile", "SpeculationPolicy", "StepPlan"]

# A padding row of a verify forward's [requests, longest rows] grid (attention, the conv and the
# delta rule run on the grid; projections, MLPs and the LM head on the real rows only) as a share of
# a real row's cost: on a 2-core CPU, the embedded pair's forward took 3.74 ms + 0.059 ms per real
# row + 0.030 ms per grid row (fit to 8 x 1, 8 x 16 and 16 + 7 x 1 rows, 4.45, 15.13 and 8.96 ms;
# `python -m dspine.benchmarks.ragged_step`), so a padding row costs 0.030 / 0.089 of a real one.
_PADDING_ROW_SHARE = 0.34
# Weight of history per new observation: 0.9 forgets a timing in about ten steps.
_COST_DECAY = 0.9
# The target-only line forgets more slowly (about fifty steps): those steps are plentiful, and a
# plan compares a drafting step against this line's estimate, so its noise selects the moments to
# draft. At 0.9, one request at top-p 0.9 on a 2-core CPU (steps 4.8 ms at p10, 8.8 ms at p99)
# planned its drafting steps when a few slow steps had lifted the estimate to 7.0 ms, while target
# steps averaged 5.5 ms: those steps needed 1.5 accepted tokens to pay, were priced at 1.1, and lost.
_TARGET_COST_DECAY = 0.98
# A kind's forecasts are scaled by what its planned cycles accepted against what they forecast
# (decayed over about twenty such cycles, with this many forecast tokens of prior at ratio 1).
# A step slower than this many times its line's estimate is read as this many times (see
# LinearCost.observe): a stall is not the machine's speed.
_STALL_FACTOR = 3.0
# Weight of history a line needs before it judges a step a stall (its first steps are its estimate).
_STALL_MIN_WEIGHT = 5.0
_CALIBRATION_DECAY = 0.95
_CALIBRATION_PRIOR_TOKENS = 2.0
_CALIBRATION_RANGE = (0.5, 1.5)
# Per request: about the last twenty cycles count (one unlucky cycle must not stop drafting).
_ACCEPT_DECAY = 0.95
_PRIOR_WEIGHT = 2.0  # pseudo-observations of the engine-wide profile in a request's estimate
_FIRST_PROBE_INTERVAL = 4
# Each kind of request backs off on its own schedule (a stream of sampled requests that do not
# pay must not delay the probes that find a greedy request's runs). A sampled probe costs about
# 1.3 target-only steps on a 2-core CPU (a cycle of 3.3 steps for 2 tokens) and sampled
# acceptance does not come in runs, so its back-off goes four times as far: at 128, 51 probes in
# 6,000 steps of one request at temperature 0.7 were 0.8% of its decode time.
_MAX_PROBE_INTERVAL = {"greedy": 64, "sampled": 256}
# Rows a probe verifies per request. Greedy acceptance comes in runs (on the embedded pair a
# fully accepted block is followed by another 90% of the time, by 3.5% otherwise), and a probe
# that stops at row 4 cannot see the run that makes drafting pay: 8 greedy requests in flight
# went from 0.98x to 1.13x target-only (virtual-time sweep) with whole-block probes. A sampled
# row is accepted about half the time, so four rows tell it all and cost less.
_PROBE_ROWS = {"greedy": 15, "sampled": 4}
_PROBE_REQUESTS = 2  # requests a probe drafts at most (the ones that drafted longest ago)
# A request's own evidence fades by this factor per decode step it does not draft, so that it leans
# on its kind's engine-wide profile again after a few target-only steps. Without it a request whose
# last cycles failed stayed target-only until a probe (up to 64 steps away): greedy acceptance is
# local to a stretch of text, and one request, 128 greedy tokens on the embedded pair, fell into
# drafting 29-32% of its steps at 1.37-1.47x in two of four fresh runs where drafting every step
# ran at 1.69-1.81x (the other two drafted 95-97% of the steps).
_IDLE_EVIDENCE_DECAY = 0.9
# Steps at most that follow plans which found nothing to draft without planning again (see
# SpeculationPolicy._quiet_step): a plan that would pay is found at most this many steps late.
_MAX_QUIET_STEPS = 4
# Quiet steps in a row once a plan has shown that no plan could pay however far the requests' own
# evidence fades (see SpeculationPolicy._cannot_pay_while_quiet), with this margin on the
# target-only rate for the cost lines' drift meanwhile: at most 4, 8 greedy requests in flight
# that drafted nothing still planned 31% of their steps.
_MAX_CERTAIN_QUIET_STEPS = 16
_CERTAIN_QUIET_MARGIN = 0.9
# Requests a step needs for quiet steps: a plan's cost grows with them (0.16 ms a step at 8 on a
# 2-core CPU, a few hundredths at 1), while a plan found late costs a lone request most (one
# greedy request, 128 tokens, read 1.50x and 1.31x with quiet steps against 1.69x and 1.45x
# without, in interleaved runs).
_QUIET_MIN_REQUESTS = 4


class LinearCost:
    """``seconds ~ intercept + slope * x``, fitted by decayed least squares; never negative.

    Until two different ``x`` have been seen the slope is unidentified; the fit then scales
    the mean time with ``prior_slope_share`` (slope as a share of the intercept), and with no
    observation at all :meth:`predict` returns None. A stall (one observation more than
    ``stall_factor`` times the line's estimate at an ``x`` inside the range seen) is read as
    ``stall_factor`` times the estimate."""

    def __init__(self, prior_slope_share: float, decay: float = _COST_DECAY, stall_factor: float = _STALL_FACTOR):
        self.prior_slope_share = prior_slope_share
        self.decay = decay
        self.stall_factor = stall_factor
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._x_range = (float("inf"), float("-inf"))
        self.num_stalls = 0

    def observe(self, x: float, seconds: float) -> None:
        # A step that stalled (a garbage collection, the OS taking a core: one target step of 122 ms
        # among steps of 2.6 ms, one request at temperature 0.7 on a 2-core CPU) lifted a target-only
        # estimate that forgets in fifty steps to 5 ms for a hundred steps, and drafting steps planned
        # against 5 ms lost. Capped at three times the estimate it moves the estimate a few percent.
        # Only between the x already seen: an estimate extrapolated on the prior slope may be far off.
        low, high = self._x_range
        # Before a line can judge a stall, its estimate is its first steps, and those can carry
        # one-time costs (a kernel compiled, a buffer allocated, the OS taking a core): one engine's
        # first drafting step stalled 100 ms on a 2-core CPU, its overhead line read 65 ms against
        # 3 ms, no probe could pay at that price, and the engine never drafted again. A step far
        # below such an estimate shows it was not the machine's speed: the line starts over.
        if (0 < self._w and not self.settled and low <= x <= high
                and not faults.active("policy.first_drafting_step_trusted")
                and seconds * self.stall_factor < self.predict(x)):
            self._w = self._x = self._y = self._xx = self._xy = 0.0
            low, high = float("inf"), float("-inf")
        if (self.settled and low <= x <= high
                and not faults.active("policy.cost_stalls_kept")):
            cap = self.stall_factor * self.predict(x)
            if seconds > cap:
                seconds = cap
                self.num_stalls += 1
        self._x_range = (min(low, x), max(high, x))
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds

    @property
    def num_observations(self) -> float:
        return self._w

    @property
    def settled(self) -> bool:
        """The line holds enough steps to judge a stall (before, its estimate is its first steps)."""
        return self._w >= _STALL_MIN_WEIGHT

    def coefficients(self) -> tuple[float, float] | None:
        """``(intercept, slope)`` or None before any observation."""
        if self._w <= 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 0.25:  # at least two distinct x with real weight
            slope = max(0.0, (self._xy / self._w - mx * my) / var)
            intercept = my - slope * mx
            if intercept >= 0:
                return intercept, slope
        intercept = my / (1.0 + self.prior_slope_share * mx)
        return intercept, self.prior_slope_share * intercept

    def predict(self, x: float) -> float | None:
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        intercept, slope = coefficients
        return intercept + slope * x


@dataclass
class CostModel:
    """Seconds of a target-only forward (by rows), of a verify forward (by its rows, see
    :meth:`verify_rows`) and of the speculative overhead (by drafted rows).

    The two forwards are separate lines: a verify also runs the verification (probabilities of
    every row when sampling) and keeps each row's features, so its cost per row is well above a
    target-only step's, and a shared line would forget the verify's slope during a stretch of
    target-only steps (the decay counts observations, and those are mostly target-only).

    A verify forward runs its projections, MLPs and LM head on the rows its requests verify (each
    request's anchor row included, riders' one row too: ``replica/models/row_packing.py``), and its
    attention, conv and delta rule on the grid of every request padded to the longest one's rows.
    A padding row of that grid costs ``_PADDING_ROW_SHARE`` of a real row, so a forward's rows are
    its real rows plus that share of its padding rows. Priced by its real rows alone, one request
    that verifies 15 rows beside 7 riders (23 rows) looked 3.2 ms cheaper than the 8.96 ms it took
    on a 2-core CPU; priced by the padded grid (128 rows), 6.2 ms dearer."""

    # A CPU's forward grows by several percent of its fixed cost per row; a GPU's barely grows.
    target_forward: LinearCost = field(default_factory=lambda: LinearCost(prior_slope_share=0.05,
                                                                          decay=_TARGET_COST_DECAY))
    verify_forward: LinearCost = field(default_factory=lambda: LinearCost(prior_slope_share=0.05))
    # by drafted rows (requests x block rows): the drafter and the tail run only the rows a plan
    # verifies, and on a CPU a row costs a few percent of the passes' fixed cost
    draft_overhead: LinearCost = field(default_factory=lambda: LinearCost(prior_slope_share=0.05))

    @staticmethod
    def padding_row_share() -> float:
        """What a padding row of a verify forward's grid costs, as a share of a real row's cost."""
        return 0.0 if faults.active("policy.verify_cost_by_unpadded_rows") else _PADDING_ROW_SHARE

    @classmethod
    def verify_rows(cls, batch: int, draft_rows: Sequence[int]) -> float:
        """Rows, in real-row units, of a verify forward of ``batch`` requests whose drafting requests
        verify ``draft_rows`` draft rows each (the others ride with one row): its real rows plus
        ``padding_row_share`` of each padding row of its grid (``batch`` x the longest one's rows)."""
        real = batch + sum(draft_rows)
        return real + cls.padding_row_share() * (batch * (1 + max(draft_rows)) - real)

    @staticmethod
    def drafted_rows(draft_rows: Sequence[int]) -> int:
        """Rows the drafter and the tail compute when requests verify ``draft_rows`` draft rows each:
        every drafting request's block is cut to the anchor and the longest one's rows."""
        return len(draft_rows) * (1 + max(draft_rows))

    def observe_target_step(self, rows: int, seconds: float) -> None:
        if faults.active("policy.target_cost_fast_decay"):
            self.target_forward.decay = _COST_DECAY
        self.target_forward.observe(rows, seconds)

    def observe_speculative(self, drafted_rows: int, rows: float, forward_seconds: float,
                            overhead_seconds: float) -> None:
        """A step whose drafter and tail computed ``drafted_rows`` rows (see :meth:`drafted_rows`)
        and whose one forward computed ``rows`` rows (see :meth:`verify_rows`: riders included)."""
        self.verify_forward.observe(rows, forward_seconds)
        self.draft_overhead.observe(drafted_rows, overhead_seconds)

    @property
    def ready(self) -> bool:
        """A speculative step has been measured (a target-only step is bounded by it until measured)."""
        return self.verify_forward.num_observations > 0 and self.draft_overhead.num_observations > 0

    def step_seconds(self, batch: int, draft_rows: Sequence[int] = ()) -> float:
        """Predicted seconds of a step of ``batch`` requests in which some draft, ``draft_rows`` rows
        each, the others riding in the cycle's verify forward or running apart, whichever is cheaper
        (see :meth:`step_cost`)."""
        return self.step_cost(batch, draft_rows)[0]

    def step_cost(self, batch: int, draft_rows: Sequence[int] = ()) -> tuple[float, bool]:
        """``(seconds, riders_apart)`` of a step of ``batch`` requests in which some draft,
        ``draft_rows`` rows each. The requests that do not draft either ride in the verify forward
        (one forward, its grid padded to the longest drafting request's rows) or run their own
        target-only forward after it (two forwards' fixed costs, no padding)."""
        if not draft_rows:
            return self.target_only_seconds(batch), False
        overhead = self.draft_overhead.predict(self.drafted_rows(draft_rows))
        riding = overhead + self.verify_forward.predict(self.verify_rows(batch, draft_rows))
        num_riders = batch - len(draft_rows)
        if num_riders <= 0 or faults.active("policy.riders_always_ride"):
            return riding, False
        apart = (overhead + self.verify_forward.predict(self.verify_rows(len(draft_rows), draft_rows))
                 + self.target_only_seconds(num_riders))
        return (apart, True) if apart < riding else (riding, False)

    def target_only_seconds(self, batch: int) -> float:
        """Predicted seconds of a target-only forward of ``batch`` requests."""
        if not batch:
            return 0.0
        if self.target_forward.num_observations == 0:
            # Not measured yet: a verify forward of as many rows costs at least as much (it also
            # verifies), so the first target-only step is chosen only when drafting gains nothing.
            return self.verify_forward.predict(batch)
        return self.target_forward.predict(batch)


class AcceptanceProfile:
    """Decayed P(row t accepted | rows 1..t-1 accepted), t = 1..num_rows, for one request or an engine."""

    def __init__(self, num_rows: int, prior: "AcceptanceProfile | None" = None, initial: float = 0.5,
                 decay: float = _ACCEPT_DECAY, prior_learns: bool = True):
        self.num_rows = num_rows
        self.prior = prior
        # a request's cycles also teach its engine-wide prior; an engine-wide profile leaning on
        # another (a run state on the other state, until it has its own data) does not teach it
        self.prior_learns = prior_learns
        self.initial = initial
        self.decay = decay
        self._accepted = [0.0] * num_rows
        self._seen = [0.0] * num_rows
        # Planning reads every candidate's profile every decode step; the estimates change only
        # when a cycle is observed (here or in the prior), so they are computed once per change.
        self.version = 0
        self._cached: tuple[tuple[int, int], list[float], list[float], list[float]] | None = None

    def _estimates(self) -> tuple[list[float], list[float]]:
        """(conditionals, gains) for all rows, recomputed only after an observation."""
        return self._cached_estimates()[1:3]

    def _cached_estimates(self) -> tuple[tuple[int, int], list[float], list[float], list[float]]:
        """(key, conditionals, gains, their running sums), recomputed only after an observation."""
        key = (self.version, self.prior.version if self.prior is not None else -1)
        if self._cached is None or self._cached[0] != key:
            # (every observation anywhere changes the engine-wide prior, so with 8 requests in flight
            # all their estimates are recomputed every step: comprehensions, not an indexed loop)
            w = _PRIOR_WEIGHT
            if self.prior is not None:
                conditionals = [(a + w * b) / (s + w)
                                for a, b, s in zip(self._accepted, self.prior.conditionals(), self._seen)]
            else:
                conditionals = []
                base = self.initial
                for a, s in zip(self._accepted, self._seen):
                    base = (a + w * base) / (s + w)
                    conditionals.append(base)
            gains = list(accumulate(conditionals, operator.mul))
            self._cached = (key, conditionals, gains, list(accumulate(gains)))
        return self._cached

    def conditionals(self, num_rows: int | None = None) -> list[float]:
        """Estimated P(row accepted | earlier rows accepted) for rows 0 .. num_rows - 1 (0-based).

        A row with little data leans on the prior: the engine-wide profile for a request, and for
        the engine the estimate of the row before (rows past the usual verify length are rarely
        observed, and a fixed guess there would keep them unverified for good)."""
        n = self.num_rows if num_rows is None else min(num_rows, self.num_rows)
        return self._estimates()[0][:n]

    def conditional(self, row: int) -> float:
        """One entry of :meth:`conditionals`."""
        return self._estimates()[0][row]

    def gains(self, max_rows: int) -> list[float]:
        """Expected accepted tokens added by verifying row t (t = 1..max_rows): P(rows 1..t accepted)."""
        return self._estimates()[1][:max(0, max_rows)]

    def expected_tokens(self, max_rows: int) -> list[float]:
        """Expected accepted tokens when verifying the first t rows, t = 1..max_rows (running sums
        of :meth:`gains`)."""
        return self._cached_estimates()[3][:max(0, max_rows)]

    def expected_tokens_at(self, num_rows: int) -> float:
        """``expected_tokens(num_rows)[-1]`` without the list (``num_rows`` >= 1)."""
        return self._cached_estimates()[3][min(num_rows, self.num_rows) - 1]

    def fade(self, factor: float) -> None:
        """Scale this profile's own evidence by ``factor`` (its prior untouched): with less of it the
        estimates lean on the prior."""
        if self._seen[0] < 0.05:
            return  # a twentieth of a cycle's evidence left: keep the cached estimates (planning is per step)
        self._accepted = [factor * a for a in self._accepted]
        self._seen = [factor * s for s in self._seen]
        self.version += 1

    def faded_conditionals(self, factor: float) -> list[float]:
        """:meth:`conditionals` as they would read after :meth:`fade` by ``factor``, the profile
        unchanged (with no prior: as they read now)."""
        if self.prior is None:
            return self.conditionals()
        w = _PRIOR_WEIGHT
        return [(factor * a + w * b) / (factor * s + w)
                for a, b, s in zip(self._accepted, self.prior.conditionals(), self._seen)]

    def observe(self, num_verified: int, accepted_len: int) -> None:
        """A cycle verified ``num_verified`` rows and accepted the first ``accepted_len`` of them."""
        for row in range(min(num_verified, accepted_len + 1)):
            self._accepted[row] = self.decay * self._accepted[row] + (1.0 if row < accepted_len else 0.0)
            self._seen[row] = self.decay * self._seen[row] + 1.0
        self.version += 1
        if self.prior is not None and self.prior_learns:
            self.prior.observe(num_verified, accepted_len)


class _RowEstimates:
    """Fixed per-row conditionals read as an :class:`AcceptanceProfile` is by the plan search."""

    def __init__(self, conditionals: list[float]):
        self._gains = list(accumulate(conditionals, operator.mul))
        self._expected = list(accumulate(self._gains))

    def gains(self, max_rows: int) -> list[float]:
        return self._gains[:max(0, max_rows)]

    def expected_tokens(self, max_rows: int) -> list[float]:
        return self._expected[:max(0, max_rows)]

    def expected_tokens_at(self, num_rows: int) -> float:
        return self._expected[min(num_rows, len(self._expected)) - 1]


@dataclass(frozen=True)
class StepPlan:
    """Draft rows to verify per request that drafts this step (absent: a target-only token)."""

    draft_rows: dict[str, int]
    is_probe: bool = False
    riders_apart: bool = False  # the others run their own target-only forward (CostModel.step_cost)


class SpeculationPolicy:
    """Chooses each step's draft rows per request from measured costs and acceptance."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.costs = CostModel()
        # Engine-wide profiles, one per kind of request and run state, learn from every request of
        # that kind and are where a new request's estimates start. Acceptance comes in runs (a
        # greedy block accepted in full is followed by another most of the time, a partly accepted
        # one rarely), so a request keeps one profile for the cycle after a block it accepted in
        # full and one for the cycle after any other: averaged into one, a run's next block was
        # forecast at the mean (3.7 of 15 rows on the embedded pair) and 8 greedy requests in flight
        # stopped drafting where whole blocks paid.
        self.engine_profiles: dict[tuple[str, bool], AcceptanceProfile] = {}
        for kind in ("greedy", "sampled"):
            after_partial = AcceptanceProfile(num_rows, initial=0.5)
            self.engine_profiles[kind, False] = after_partial
            self.engine_profiles[kind, True] = AcceptanceProfile(num_rows, prior=after_partial, prior_learns=False)
        self._profiles: dict[str, dict[bool, AcceptanceProfile]] = {}
        self._in_run: dict[str, bool] = {}  # request id -> its last cycle accepted every row it verified
        self._kinds: dict[str, str] = {}  # request id -> "greedy" or "sampled"
        self._last_drafted: dict[str, int] = {}  # request id -> the decode step it last drafted in
        # Per kind of request and batch size: decode steps of that batch since one of that kind drafted
        # in it, and its probe interval. Whether drafting pays depends on the batch (a target-only
        # step of 8 requests costs 1.3 of one request's on a 2-core CPU, a drafter pass per request
        # does not shrink), so a step that paid with 2 requests left at a closed group's end says
        # nothing of the next group's 8 and must not restart their probes at every 4th step. (In
        # the sweep's 8-greedy row most probes of 8 follow paid steps of 8 all the same: 55 in 28
        # groups before this, 59 after.)
        self._steps_without_draft: dict[tuple[str, int], int] = {}
        self._probe_interval: dict[tuple[str, int], int] = {}
        # The last planned drafting step, until it is judged: (accepted tokens it needed to beat a
        # target-only step, its drafting requests, the tokens they accepted so far, the probe
        # schedules (kind, batch) it restarts if it paid).
        self._unjudged: tuple[float, frozenset[str], list[int], frozenset[tuple[str, int]]] | None = None
        # Per kind: decayed (tokens accepted, tokens forecast) over the cycles of planned drafting
        # steps, and the raw forecasts of the last plan's requests until their cycles are observed.
        # A plan drafts the requests whose estimates are highest just then, so what its cycles accept
        # falls short of their forecast (one request at top-p 0.9: 1.17 accepted for 1.69 forecast
        # over its planned steps, 1.27 for 1.10 over its probes, which the schedule picks blind).
        self._calibration = {kind: [0.0, 0.0] for kind in _MAX_PROBE_INTERVAL}
        self._planned_forecasts: dict[str, float] = {}
        self.num_probes = 0
        self.num_probes_skipped = 0  # steps whose due probe was not made: not even a perfect cycle would pay
        # (signature of the last plans' inputs, rows per request, plans in a row that found nothing, quiet steps left)
        self._quiet: tuple[tuple, dict[str, int], int, int] | None = None
        # While a stretch of quiet steps holds: the scheduler's roster of the step that set it (see
        # :meth:`continues_quiet_stretch`) and its probe schedules
        self._quiet_roster: tuple[tuple, frozenset[tuple[str, int]]] | None = None
        self._pending_fades: dict[str, int] = {}  # request id -> fades owed from quiet steps
        self.num_quiet_steps = 0
        self._skipped_probe: tuple | None = None  # the quiet signature of the last probe not made
        self._stretch_fades: tuple[frozenset, int] | None = None  # (the stretch's requests, fades owed)
        self.num_decode_steps = 0
        self.num_drafting_steps = 0

    # ------------------------------------------------------------ planning
    def profile(self, request_id: str, sampled: bool = False) -> AcceptanceProfile:
        """The request's profile for its next cycle: after a block it accepted in full, or after any
        other (created on first use, from the engine-wide ones of its kind)."""
        if request_id not in self._profiles:
            kind = "sampled" if sampled else "greedy"
            self._kinds[request_id] = kind
            self._profiles[request_id] = {in_run: AcceptanceProfile(self.num_rows, prior=self.engine_profiles[kind, in_run])
                                          for in_run in (False, True)}
        in_run = self._in_run.get(request_id, False) and not faults.active("policy.acceptance_without_runs")
        return self._profiles[request_id][in_run]

    def continues_quiet_stretch(self, roster: tuple) -> bool:
        """Whether this step is a quiet step that only counts (:meth:`_counted_quiet_step`) and has
        been counted, read from ``roster`` alone: the scheduler's (speculative request ids in order,
        number of target-only requests) of this step, as it passed to the last :meth:`plan`. Then
        the step drafts nothing and the scheduler need not build the plan's inputs.

        The same roster means the same candidates with no more rows (a request's rows only shrink
        as its output grows); with the engine-wide profiles unchanged and no probe due the step's
        plan would be the counted quiet step this one counts. With 8 requests in flight, building
        the inputs and finding the step quiet was 65 us of a 10.6 ms step on a 2-core CPU."""
        if self._quiet_roster is None or self._quiet_roster[0] != roster or self._quiet is None:
            return False
        if faults.active("policy.quiet_steps_do_the_bookkeeping"):
            return False
        signature, caps, streak, left = self._quiet
        if left <= 0 or signature[2] != self._engine_versions():
            return False
        schedules = self._quiet_roster[1]
        # a probe found unable to pay in this stretch stays skipped here too (8 greedy requests of
        # a closed group: 1,885 of 2,028 steps, each planned in full while the shortcut gave way)
        skipped = self._due_probes_skipped(signature, schedules, shortcut=True)
        if skipped is None:
            return False  # plan() decides the probe
        self._quiet = (signature, caps, streak, left - 1)
        self.num_quiet_steps += 1
        self._count_quiet_step(signature, schedules, skipped=skipped)
        return True

    def plan(self, candidates: dict[str, int], num_target_only: int = 0, sampled: frozenset[str] = frozenset(),
             remaining: Mapping[str, int] | None = None, refill_share: float = 1.0, roster: tuple | None = None,
             ) -> StepPlan:
        """``candidates``: request id -> the most draft rows worth verifying for it (its remaining
        output budget less one, capped at the block); ``num_target_only``: other requests of the step
        that decode target-only anyway; ``sampled``: the candidates that sample (temperature > 0);
        ``remaining``: every request of the step -> the output tokens it may still emit, and
        ``refill_share``: the share of freed slots that new requests take (see
        ``replica/drain_pricing.py``; None or 1: every accepted token counts in full).
        Returns the rows each drafting request verifies.
        ``roster``: the scheduler's key of this step for :meth:`continues_quiet_stretch` (None:
        the next step is planned in full)."""
        plan = self._planned(candidates, num_target_only, sampled, remaining, refill_share)
        self._quiet_roster = None
        if roster is not None and self._quiet is not None and not plan.draft_rows:
            batch = len(candidates) + num_target_only
            self._quiet_roster = (roster, frozenset(self._schedule(self._kinds[r], batch) for r in candidates))
        return plan

    def _planned(self, candidates: dict[str, int], num_target_only: int = 0, sampled: frozenset[str] = frozenset(),
                 remaining: Mapping[str, int] | None = None, refill_share: float = 1.0) -> StepPlan:
        """The step's plan without the roster of :meth:`plan`."""
        if not candidates:
            return StepPlan({})
        quiet = self._quiet_step(candidates, num_target_only, sampled)
        if quiet and self._counted_quiet_step(candidates, num_target_only):
            return StepPlan({})
        if self._stretch_fades:  # owed by every candidate of the stretch's quiet steps
            for request_id in self._stretch_fades[0].intersection(candidates):
                self._pending_fades[request_id] = self._pending_fades.get(request_id, 0) + self._stretch_fades[1]
            self._stretch_fades = None
        if not quiet:
            for request_id in candidates:  # the fades of the quiet steps before, before it plans
                times = self._pending_fades.pop(request_id, 0)
                if times:
                    self._fade(request_id, times)
        plan = self._plan(candidates, num_target_only, sampled, remaining, refill_share, quiet=quiet)
        if not faults.active("policy.idle_evidence_kept"):
            for request_id in candidates:
                if request_id not in plan.draft_rows:
                    if quiet:  # nothing reads the estimates until the next plan: fade them then
                        self._pending_fades[request_id] = self._pending_fades.get(request_id, 0) + 1
                    else:
                        self._fade(request_id)
        return plan

    def _fade(self, request_id: str, times: int = 1) -> None:
        for profile in self._profiles[request_id].values():
            profile.fade(_IDLE_EVIDENCE_DECAY ** times)

    def _counted_quiet_step(self, candidates: dict[str, int], num_target_only: int) -> bool:
        """A quiet step that only counts: no probe of its requests' kinds comes due (or the one due
        was found unable to pay earlier in this stretch), so nothing but the counters moves (its
        fades are owed by the whole stretch at once). False: :meth:`_plan` decides the probe.

        Most steps of 8 requests that do not pay are such steps; the plan's bookkeeping of a quiet
        step (profiles, the probe schedule, the fades owed, per request) was 45-70 us of a 5.5 ms
        step on a 2-core CPU."""
        if faults.active("policy.quiet_steps_do_the_bookkeeping"):
            return False
        signature = self._quiet[0]
        batch = len(candidates) + num_target_only
        schedules = {self._schedule(kind, batch) for kind in {self._kinds[r] for r in candidates}}
        skipped = self._due_probes_skipped(signature, schedules)
        if skipped is None:
            return False
        self._count_quiet_step(signature, schedules, skipped)
        return True

    def _due_probes_skipped(self, signature: tuple, schedules, shortcut: bool = False) -> bool | None:
        """For a quiet step of stretch ``signature`` that only counts: whether a probe of
        ``schedules`` comes due on it and was already found unable to pay in this stretch (True),
        none comes due (False), or one comes due unjudged (None: :meth:`_plan` decides it).
        ``shortcut``: asked by :meth:`continues_quiet_stretch` (its faults apply)."""
        if shortcut and faults.active("policy.quiet_shortcut_past_due_probes"):
            return False
        interval = self._probe_interval
        if not any(self._steps_without_draft.get(schedule, 0) + 1 >= interval.get(schedule, _FIRST_PROBE_INTERVAL)
                   for schedule in schedules):
            return False
        if self._skipped_probe == signature:
            return True
        return True if shortcut and faults.active("policy.quiet_shortcut_skips_unjudged_probes") else None

    def _count_quiet_step(self, signature: tuple, schedules, skipped: bool) -> None:
        """The counters a quiet step that only counts moves (its probe schedules', the stretch's fades)."""
        for schedule in schedules:
            self._steps_without_draft[schedule] = self._steps_without_draft.get(schedule, 0) + 1
        self.num_probes_skipped += skipped
        self.num_decode_steps += 1
        if not faults.active("policy.idle_evidence_kept"):
            ids, times = self._stretch_fades or (signature[0], 0)
            self._stretch_fades = (ids, times + 1)

    def _engine_versions(self) -> tuple:
        """The engine-wide profiles' versions (a cycle observed since moves one)."""
        if faults.active("policy.quiet_steps_ignore_cycles"):
            return ()
        return tuple(profile.version for profile in self.engine_profiles.values())

    def _quiet_step(self, candidates: dict[str, int], num_target_only: int,
                    sampled: frozenset[str] = frozenset()) -> bool:
        """Whether this step skips planning: the same requests (and rows) as the last plans, which
        found nothing to draft, and no cycle observed since (the engine-wide profiles unchanged).

        Only steps of at least ``_QUIET_MIN_REQUESTS`` requests, or whose candidates all sample:
        sampled acceptance does not come in runs, so a plan found a few steps late loses little,
        while planning was 1% of a lone sampled request's steps. After ``n`` such plans in a row
        the next ``min(n, _MAX_QUIET_STEPS)`` steps are not planned (``_MAX_CERTAIN_QUIET_STEPS``
        once :meth:`_cannot_pay_while_quiet` holds);
        only the per-step fades (applied before the next plan) and the cost lines move their
        inputs meanwhile. With 8 greedy requests in flight that drafted nothing, planning was
        0.16-0.17 ms of a 6.5 ms step on a 2-core CPU."""
        all_sampled = sampled.issuperset(candidates) and not faults.active("policy.quiet_steps_need_many_requests")
        if len(candidates) + num_target_only < _QUIET_MIN_REQUESTS and not all_sampled:
            self._quiet = None
            return False
        signature = (frozenset(candidates), num_target_only, self._engine_versions())
        # Rows that only shrink (a request's last tokens cap them) keep the stretch: every plan with
        # fewer rows was one with more rows verifying less, which cost no less and gained no more.
        if (self._quiet is None or self._quiet[0] != signature
                or any(rows > self._quiet[1][r] for r, rows in candidates.items())):
            self._quiet = (signature, dict(candidates), 0, 0)
            return False
        _, _, streak, left = self._quiet
        self._quiet = (signature, dict(candidates), streak, max(0, left - 1))
        if left > 0:
            self.num_quiet_steps += 1
            return True
        return False

    def _after_plan(self, drafted: bool, certain: bool = False) -> None:
        """A planned step (not a quiet one) found a plan (``drafted``) or none (``certain``: and none
        could pay until a cycle is observed, :meth:`_cannot_pay_while_quiet`)."""
        if self._quiet is None:
            return
        if drafted:
            self._quiet = None
            return
        signature, caps, streak, _ = self._quiet
        left = _MAX_CERTAIN_QUIET_STEPS if certain else min(streak + 1, _MAX_QUIET_STEPS)
        self._quiet = (signature, caps, streak + 1, left)

    def _plan(self, candidates: dict[str, int], num_target_only: int, sampled: frozenset[str],
              remaining: Mapping[str, int] | None = None, refill_share: float = 1.0, quiet: bool = False,
              ) -> StepPlan:
        for request_id in candidates:
            self.profile(request_id, request_id in sampled)
        self.num_decode_steps += 1
        self._judge_last_drafting_step()
        self._planned_forecasts = {}
        batch = len(candidates) + num_target_only
        if not self.costs.ready:  # nothing measured yet: draft everything once to learn
            return self._drafting(StepPlan({r: m for r, m in candidates.items() if m > 0}), batch)
        rows, riders_apart, pricing = {}, False, None
        if not quiet:
            pricing = self._pricing(candidates, remaining, refill_share)
            rows, riders_apart = self._best_rows(candidates, num_target_only, pricing=pricing)
            self._after_plan(bool(rows), certain=not rows and self._quiet is not None
                             and self._cannot_pay_while_quiet(candidates, num_target_only, pricing))
        if rows:
            schedules = frozenset((self._kinds[r], batch) for r in rows)
            if faults.active("policy.probe_interval_reset_by_any_draft"):
                self._restart_probes(schedules)
            self._unjudged = (self._break_even(rows, batch), frozenset(rows), [0], schedules)
            self._planned_forecasts = {r: sum(self.profile(r).gains(n)) for r, n in rows.items()}
            return self._drafting(StepPlan(rows, riders_apart=riders_apart), batch)
        due = []
        for kind in sorted({self._kinds[r] for r in candidates}):
            schedule = self._schedule(kind, batch)
            self._steps_without_draft[schedule] = self._steps_without_draft.get(schedule, 0) + 1
            interval = self._probe_interval.get(schedule, _FIRST_PROBE_INTERVAL)
            if self._steps_without_draft[schedule] >= interval:
                due.append(kind)
        if due:
            # the requests that drafted longest ago: a probe's cost grows with the requests it drafts
            oldest = sorted((r for r, m in candidates.items() if m > 0 and self._kinds[r] in due),
                            key=lambda r: self._last_drafted.get(r, -1))
            probe = {r: min(candidates[r], _PROBE_ROWS[self._kinds[r]]) for r in oldest[:_PROBE_REQUESTS]}
            if probe and not self._probe_could_pay(
                    probe, batch, pricing or self._pricing(candidates, remaining, refill_share)):
                # still due, its back-off unchanged: the next step where a probe could pay makes it
                # (a lone request's last rows cannot, the next request's first ones can); within a
                # stretch of quiet steps, whose inputs are the stretch's, it is not asked again
                self.num_probes_skipped += 1
                self._skipped_probe = self._quiet[0] if self._quiet is not None else None
                return StepPlan({})
            for kind in due:
                schedule = self._schedule(kind, batch)
                self._probe_interval[schedule] = min(2 * self._probe_interval.get(schedule, _FIRST_PROBE_INTERVAL),
                                                     _MAX_PROBE_INTERVAL[kind])
            self.num_probes += bool(probe)
            riders_apart = bool(probe) and self.costs.step_cost(batch, list(probe.values()))[1]
            return self._drafting(StepPlan(probe, is_probe=True, riders_apart=riders_apart), batch)
        return StepPlan({})

    def forecast_calibration(self, kind: str) -> float:
        """The factor on a kind's forecast gains (within ``_CALIBRATION_RANGE``): the tokens its planned
        drafting cycles accepted over those they were forecast, with a prior at 1."""
        if faults.active("policy.forecast_uncalibrated"):
            return 1.0
        accepted, forecast = self._calibration[kind]
        ratio = (accepted + _CALIBRATION_PRIOR_TOKENS) / (forecast + _CALIBRATION_PRIOR_TOKENS)
        return min(_CALIBRATION_RANGE[1], max(_CALIBRATION_RANGE[0], ratio))

    def probe_interval(self, kind: str, batch: int = 1) -> int:
        """Decode steps of ``batch`` requests a kind of request ("greedy" or "sampled") waits for its
        next probe now."""
        return self._probe_interval.get(self._schedule(kind, batch), _FIRST_PROBE_INTERVAL)

    @staticmethod
    def _schedule(kind: str, batch: int) -> tuple[str, int]:
        """The key of a kind's probe schedule at a batch size (one for all sizes under the fault)."""
        return (kind, 0 if faults.active("policy.probe_schedule_shared_across_batches") else batch)

    def _restart_probes(self, schedules) -> None:
        """``schedules``: (kind, batch) pairs whose back-off starts over."""
        for kind, batch in schedules:
            self._probe_interval[self._schedule(kind, batch)] = _FIRST_PROBE_INTERVAL

    def _break_even(self, rows: dict[str, int], batch: int) -> float:
        """Accepted draft tokens a step drafting ``rows`` (``batch`` requests in all) must commit to
        beat a target-only step: its predicted seconds at the target-only rate, less the one token
        each request commits anyway."""
        seconds = self.costs.step_seconds(batch, list(rows.values()))
        return seconds * batch / self.costs.step_seconds(batch) - batch

    def _judge_last_drafting_step(self) -> None:
        """Restart the probes' back-off if the last planned drafting step paid."""
        if self._unjudged is None:
            return
        needed, _, accepted, schedules = self._unjudged
        self._unjudged = None
        if accepted[0] >= needed:  # (its requests may have finished since: their schedules were kept)
            self._restart_probes(schedules)

    def _drafting(self, plan: StepPlan, batch: int) -> StepPlan:
        for request_id in plan.draft_rows:
            self._last_drafted[request_id] = self.num_decode_steps
        if plan.draft_rows:
            self.num_drafting_steps += 1
            for kind in {self._kinds[r] for r in plan.draft_rows}:
                self._steps_without_draft[self._schedule(kind, batch)] = 0
        return plan

    def _best_rows(self, candidates: dict[str, int], num_target_only: int, prune: bool = True,
                   remaining: Mapping[str, int] | None = None, refill_share: float = 1.0,
                   pricing: DrainPricing | None = None, profiles: Mapping[str, "_RowEstimates"] | None = None,
                   rate_factor: float = 1.0) -> tuple[dict[str, int], bool]:
        """The plan with the most tokens per second, if it beats target-only, and whether its riders
        run apart: for each longest row count T, each request's rows and the requests that draft.

        At a longest row count T a step costs a fixed part, per drafting request the drafter's
        ``1 + T`` rows and (riders apart) its share of the padded grid, and per verified row one
        real row of the verify forward (:meth:`CostModel.verify_rows`). For a rate ``r`` to beat, a
        plan beats it exactly when its tokens less ``r`` times its seconds are positive, and that
        difference splits by request: each request verifies the rows whose gain exceeds ``r`` times
        a real row's seconds (its gains only fall row by row, so they are its first rows, up to T),
        and of ``k`` drafting requests the best are the ``k`` whose rows gain most over their cost.
        So for each T the search ranks the requests at the best rate found so far, prices every
        prefix of that ranking (riding and apart), and ranks again at the better rate a prefix
        found, until none is better: then no plan at T beats it (Dinkelbach's method). Runs every
        decode step on the engine's thread: the cost lines are read once. ``prune``: skip the T that
        no plan could win with (:meth:`_may_beat`); False searches them all, the reference the
        pruning is tested against.

        ``remaining`` and ``refill_share`` price the tokens (``replica/drain_pricing.py``; ``pricing``:
        that pricing already made from them): where freed
        slots stay empty a token is worth less, except one that shortens the batch's longest remaining
        output, which every one of the critical requests must accept (so a plan that counts it drafts
        all of them; then each of them verifies its first T rows in every plan, and the others are
        ranked as above). ``profiles``: each
        candidate's estimates in place of its own; ``rate_factor``: a plan must beat that share of the
        target-only rate."""
        batch = len(candidates) + num_target_only
        best_rate = rate_factor * batch / self.costs.step_seconds(batch)
        overhead_intercept, overhead_slope = self.costs.draft_overhead.coefficients()
        verify_intercept, verify_slope = self.costs.verify_forward.coefficients()
        padding_share = self.costs.padding_row_share()
        real_row_seconds = verify_slope * (1 - padding_share)  # a row the forward computes packed
        grid_row_seconds = verify_slope * padding_share  # a row of its [requests, 1 + T] grid
        # the riders' own target-only forward, by their number (CostModel.step_cost); inf: they ride.
        # Read only once a row count passes the bound below (most steps of sampled requests: none).
        riders_seconds: list[float] = []
        calibration = {kind: self.forecast_calibration(kind) for kind in self._calibration}
        drafting_candidates = {r: (profiles[r] if profiles is not None else self.profile(r),
                                   calibration[self._kinds[r]], m)
                               for r, m in candidates.items() if m > 0}
        best: tuple[dict[str, int], bool] = ({}, False)
        base = overhead_intercept + verify_intercept
        if pricing is None:
            pricing = self._pricing(candidates, remaining, refill_share)
        value = pricing.token_value
        has_lead = bool(pricing.critical) and pricing.lead_token_value > 0
        num_critical = len(pricing.critical)

        def per_request(longest: int) -> float:
            """The least seconds a drafting request adds at T rows: the drafter's rows, its grid rows
            and two real rows (its anchor and one draft row)."""
            return (overhead_slope + grid_row_seconds) * (1 + longest) + 2 * real_row_seconds

        # Every T at once, from one number per request: none gains more than over all its rows, none
        # costs less than at T = 1. Most steps of requests that do not pay end here.
        if prune and drafting_candidates:
            whole = {r: c * p.expected_tokens_at(m) for r, (p, c, m) in drafting_candidates.items()}
            # the critical requests' shortest run is at most the least any of them expects
            lead_bound = pricing.lead_token_value * min(pricing.lead, min(
                whole[r] for r in pricing.critical)) if has_lead else 0.0
            if not self._may_beat(best_rate, batch, [value * w for w in whole.values()], base,
                                  per_request(1), lead_bound, num_critical):
                return {}, False
        # the lead the critical requests may gain together over their first T rows, T = 1..num_rows
        leads = [pricing.lead_token_value * min(pricing.lead, run) for run in shortest_runs(
            [[c * g for g in p.gains(m)] for r, (p, c, m) in drafting_candidates.items() if r in pricing.critical],
            self.num_rows)] if has_lead else []
        # the critical requests drafting first, then the others by gain: a plan of its own unless
        # every candidate is critical
        critical_first = bool(leads) and num_critical < len(drafting_candidates)
        request_ids = list(drafting_candidates)
        # per request: the gain of each of its rows (falling row by row) and its expected tokens over
        # its first t rows, t = 1..its cap
        row_gains = {r: [value * c * g for g in p.gains(m)] for r, (p, c, m) in drafting_candidates.items()}
        expected = {r: list(accumulate(g)) for r, g in row_gains.items()}
        # where a lead is priced the critical requests verify all their rows up to T in every plan
        # (the lead is priced so): a restriction of the search there, not an exact optimum
        whole_rows = set(pricing.critical) if leads else set()
        most_rows = max((len(e) for e in expected.values()), default=0)
        priced_at, row_price, paying_rows = None, 0.0, {}
        for longest in range(1, most_rows + 1):
            lead = leads[longest - 1] if leads else 0.0
            if prune and not self._may_beat(
                    best_rate, batch, [e[min(longest, len(e)) - 1] for e in expected.values()], base,
                    per_request(longest), lead, num_critical):
                continue
            if not riders_seconds:
                riders_seconds = self._riders_seconds(batch)
            drafting_seconds = overhead_slope * (1 + longest)  # per drafting request: CostModel.drafted_rows
            grid_seconds = grid_row_seconds * (1 + longest)  # per request of the forward
            riders_grid = base + real_row_seconds * batch + grid_seconds * batch
            improved = True
            while improved:
                improved = False
                if priced_at != best_rate:  # each request's rows worth their seconds at this rate
                    priced_at, row_price = best_rate, best_rate * real_row_seconds
                    paying_rows = {r: len(expected[r]) if r in whole_rows
                                   else max(1, bisect_left(row_gains[r], -row_price, key=operator.neg))
                                   for r in request_ids}
                rows, net = {}, {}
                for r in request_ids:
                    n = min(longest, paying_rows[r])
                    rows[r] = n
                    net[r] = expected[r][n - 1] - row_price * n
                ranked = sorted(request_ids, key=lambda r: (-net[r], r))
                orders = [ranked]
                if critical_first and lead > 0:
                    orders.append(sorted(ranked, key=lambda r: r not in pricing.critical))
                for order in orders:
                    tokens, verified, critical_in = float(batch), 0, 0
                    for count, request_id in enumerate(order, start=1):
                        tokens += expected[request_id][rows[request_id] - 1]
                        verified += rows[request_id]
                        critical_in += request_id in pricing.critical
                        riding = riders_grid + real_row_seconds * verified
                        apart = (base + real_row_seconds * (count + verified) + grid_seconds * count
                                 + riders_seconds[batch - count]) if count < batch else riding
                        seconds = drafting_seconds * count + min(riding, apart)
                        worth = tokens + (lead if critical_in == num_critical else 0.0)
                        if worth / seconds > best_rate:
                            best_rate, improved = worth / seconds, True
                            best = ({r: rows[r] for r in order[:count]}, apart < riding)
        return best

    def _cannot_pay_while_quiet(self, candidates: dict[str, int], num_target_only: int,
                                pricing: DrainPricing) -> bool:
        """Whether no plan could beat target-only (by ``_CERTAIN_QUIET_MARGIN``) over the next
        ``_MAX_CERTAIN_QUIET_STEPS`` steps unless a cycle is observed.

        Until then a request's estimates move only by its fades, and a conditional faded by ``f``,
        ``(f a + w p) / (f s + w)``, moves monotonically from the present one toward the prior's
        ``p`` as ``f`` falls: after at most n fades it lies between the present one and the one
        after n. With each row at the larger of those two, no fade of the stretch gains more, so
        the plan search over those estimates finding nothing certifies the stretch (the search is
        made once a stretch). Bounded by the prior's ``p`` instead (every fade, however many), 8
        greedy requests of a closed group, whose engine-wide profile says runs pay, were never
        certified and planned every 5th step, 0.6 ms a plan: 1.5% of their 10 ms steps on a 2-core CPU."""
        if faults.active("policy.quiet_steps_uncertified"):
            return False
        horizon = 4 if faults.active("policy.quiet_certificate_horizon_short") else _MAX_CERTAIN_QUIET_STEPS
        faded = _IDLE_EVIDENCE_DECAY ** horizon
        optimistic = {}
        for request_id in candidates:
            profile = self.profile(request_id)
            own = profile.conditionals()
            if profile.prior is not None and not faults.active("policy.quiet_certificate_ignores_fades"):
                later = (profile.prior.conditionals() if faults.active("policy.quiet_certificate_past_the_stretch")
                         else profile.faded_conditionals(faded))
                own = [max(now, then) for now, then in zip(own, later)]
            optimistic[request_id] = _RowEstimates(own)
        rows, _ = self._best_rows(candidates, num_target_only, pricing=pricing, profiles=optimistic,
                                  rate_factor=_CERTAIN_QUIET_MARGIN)
        return not rows

    def _pricing(self, candidates: dict[str, int], remaining: Mapping[str, int] | None,
                 refill_share: float) -> DrainPricing:
        """How this step's accepted tokens are valued (``replica/drain_pricing.py``)."""
        target_line = (self.costs.target_forward.coefficients()
                       if self.costs.target_forward.num_observations > 0 else None)
        return drain_pricing(remaining, [r for r, m in candidates.items() if m > 0], refill_share, target_line)

    def _probe_could_pay(self, probe: dict[str, int], batch: int, pricing: DrainPricing) -> bool:
        """Whether the probe's step would beat a target-only one if its requests accepted every row.

        A probe of 2 of 8 greedy requests in a closed group costs about 3 target-only steps, and
        what it finds can only make those two run ahead of the others (their tokens are worth 0.4
        of a loaded replica's there): 39 such probes in 12 groups of 8 were 6% of the decode time
        on a 2-core CPU. Where even a perfect cycle would not pay, the probe is not made. Until the
        drafting steps' cost lines hold a few steps (their estimate may be a first step's one-time
        cost, see :meth:`LinearCost.observe`), the probe is made: only drafting steps measure them."""
        if (not (self.costs.verify_forward.settled and self.costs.draft_overhead.settled)
                and not faults.active("policy.first_drafting_step_trusted")):
            return True
        tokens = batch + pricing.token_value * sum(probe.values())
        if pricing.critical and pricing.critical <= set(probe):
            tokens += pricing.lead_token_value * min(pricing.lead, min(probe.values()))
        return tokens / self.costs.step_seconds(batch, list(probe.values())) > batch / self.costs.step_seconds(batch)

    def _riders_seconds(self, batch: int) -> list[float]:
        """Seconds of the riders' own target-only forward by their number, 0..batch - 1 (inf: they ride)."""
        apart_allowed = not faults.active("policy.riders_always_ride")
        return [0.0] + [self.costs.target_only_seconds(n) if apart_allowed else float("inf") for n in range(1, batch)]

    @staticmethod
    def _may_beat(best_rate: float, batch: int, gains: Sequence[float], base: float, per_request: float,
                  lead: float = 0.0, num_critical: int = 0) -> bool:
        """Whether some plan that drafts ``k`` of the requests over T rows (``gains``: their expected
        tokens; ``per_request``: the drafter's and the verify's seconds per drafting request at T
        rows, over the fixed ``base``) could beat ``best_rate`` tokens per second.

        Checked before the requests are ranked: most steps of requests that do not pay stop here,
        and ranking them for every T was most of a plan's time (about 90 us a step with 8 in
        flight, 1-2% of a CPU target step). A k-request plan costs at least ``base + k *
        per_request`` and commits at most ``batch + k * max(gains)`` tokens (and never more than
        ``batch + sum(gains)``), a ratio monotone in k, so its best is at k = 1 or k = all.

        ``lead``: what a plan that drafts all ``num_critical`` critical requests gains on top (drain
        pricing); such a plan drafts at least that many, so it is bounded the same way from k =
        ``num_critical`` on, and the plans without the lead as before."""
        top, total, count = max(gains), sum(gains), len(gains)
        unsound = faults.active("policy.plan_bound_unsound")

        def bound(extra: float, fewest: int) -> float:
            """The best rate of plans of ``fewest`` to ``count`` requests, ``extra`` tokens on top."""
            first = (batch + extra + fewest * top) / (base + fewest * per_request)
            # k * top, not the k = all plan's own tokens: the bound must hold for every k in between
            every = (batch + extra + (total if unsound else count * top)) / (base + count * per_request)
            return min(max(first, every), (batch + extra + total) / (base + fewest * per_request))

        # the slack: a bound equal to a plan's rate must not drop it by a rounding of the division
        floor = best_rate * (1 - 1e-12)
        return bound(0.0, 1) > floor or (lead > 0 and num_critical > 0 and bound(lead, num_critical) > floor)

    # ------------------------------------------------------------ learning
    def observe_cycle(self, request_id: str, num_verified: int, accepted_len: int) -> None:
        if self._unjudged is not None and request_id in self._unjudged[1]:
            self._unjudged[2][0] += accepted_len
        forecast = self._planned_forecasts.pop(request_id, None)
        if forecast is not None:
            sums = self._calibration[self._kinds[request_id]]
            sums[0] = _CALIBRATION_DECAY * sums[0] + accepted_len
            sums[1] = _CALIBRATION_DECAY * sums[1] + forecast
        self.profile(request_id).observe(num_verified, accepted_len)
        self._in_run[request_id] = 0 < num_verified <= accepted_len

    def forget(self, request_id: str) -> None:
        self._profiles.pop(request_id, None)
        self._pending_fades.pop(request_id, None)
        self._in_run.pop(request_id, None)
        self._kinds.pop(request_id, None)
        self._last_drafted.pop(request_id, None)

    @property
    def drafting_share(self) -> float:
        """Share of decode steps that drafted (0 before any)."""
        return self.num_drafting_steps / self.num_decode_steps if self.num_decode_steps else 0.0
