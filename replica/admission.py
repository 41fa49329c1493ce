"""Admission by memory: a request is admitted only when its reservation fits every pool it uses.

A pool is anything with the small :class:`KvCapacity` interface (a name, a capacity in tokens
or None for unbounded, the tokens a request of n positions takes, the tokens free now). The
engine has two today:

- the draft KV pool (:class:`DraftPoolCapacity`, dense or ring: a ring request never holds more
  than its window), used by speculative requests only;
- the target's K/V (:class:`TargetTokenCapacity`): unbounded unless ``EngineConfig.target_kv_tokens``
  is set. A paged target pool plugs in through :class:`PagedKvCapacity` (blocks x block size).

:class:`MemoryAdmission` keeps a ledger of reservations: a request reserves, in each pool it
uses, the tokens of ``prompt + max_new_tokens`` (capped by ``max_seq_len``) or, with the
``"prompt"`` policy, of ``prompt + one block``. The sum of reservations never exceeds a
pool's capacity, and a request never holds more than it reserved under the default policy,
so an admitted request never runs a pool out. What a router reads (``free_tokens``) is the
capacity not yet reserved: where the next request fits.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .errors import PoolExhaustedError, RequestTooLargeError
from .request import Request


@runtime_checkable
class KvCapacity(Protocol):
    """One memory pool, in tokens (positions)."""

    name: str
    speculative_only: bool  # only speculative requests hold tokens here (the draft pool)

    def capacity_tokens(self) -> int | None:
        """Tokens the pool can hand out in all; None: unbounded."""

    def tokens_for(self, num_positions: int) -> int:
        """Tokens a request of ``num_positions`` positions holds at most (ring: its window; paged: whole blocks)."""

    def free_tokens(self) -> int | None:
        """Tokens not held by any request now (live); None: unbounded."""


class DraftPoolCapacity:
    """The draft KV pool (:mod:`dspine.replica.draft_kv_pool`), dense or ring."""

    name = "draft KV pool"
    speculative_only = True

    def __init__(self, pool):
        self.pool = pool
        self.window = getattr(pool, "window", None)  # RingDraftKVPool only

    def capacity_tokens(self) -> int:
        return self.pool.capacity

    def tokens_for(self, num_positions: int) -> int:
        return num_positions if self.window is None else min(num_positions, self.window)

    def free_tokens(self) -> int:
        return self.pool.num_free


class TargetTokenCapacity:
    """The target's K/V today (per-request buffers): bounded only by a configured token capacity."""

    name = "target K/V"
    speculative_only = False

    def __init__(self, capacity: int | None, used_tokens=lambda: 0):
        self.capacity = capacity
        self._used_tokens = used_tokens  # () -> positions held by live states

    def capacity_tokens(self) -> int | None:
        return self.capacity

    def tokens_for(self, num_positions: int) -> int:
        return num_positions

    def free_tokens(self) -> int | None:
        return None if self.capacity is None else self.capacity - self._used_tokens()


class PagedKvCapacity:
    """A paged K/V pool with ``num_blocks``, ``block_size``, ``num_free_blocks`` and ``blocks_needed(n)``."""

    name = "target K/V"
    speculative_only = False

    def __init__(self, pool, verify_rows: int = 0):
        self.pool = pool
        # A verify writes its rows' K/V before the commit keeps the accepted prefix, so a request
        # briefly holds up to ``verify_rows`` positions past the committed ones.
        self.verify_rows = verify_rows

    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - 1) * self.pool.block_size  # block 0 is the padding sink

    def tokens_for(self, num_positions: int) -> int:
        return self.pool.blocks_needed(num_positions + self.verify_rows) * self.pool.block_size

    def free_tokens(self) -> int:
        return self.pool.num_free_blocks * self.pool.block_size


class MemoryAdmission:
    """The reservation ledger over the engine's pools (not thread-safe: the engine's ``_lock`` guards it)."""

    def __init__(self, pools: list[KvCapacity], max_seq_len: int, reservation: str = "max_new_tokens",
                 block_size: int = 1):
        if reservation not in ("max_new_tokens", "prompt"):
            raise ValueError(f"admission_reservation: must be 'max_new_tokens' or 'prompt', got {reservation!r}")
        self.pools = list(pools)
        self.max_seq_len = max_seq_len
        self.reservation = reservation
        self.block_size = max(block_size, 1)
        self._reserved: dict[str, dict[str, int]] = {}  # request_id -> pool name -> tokens
        self._totals: dict[str, int] = {p.name: 0 for p in self.pools}

    def positions(self, request: Request) -> int:
        """Positions the request reserves: its prompt and what it may generate (or one block)."""
        prompt = request.stats.num_prompt_tokens
        more = request.params.max_new_tokens if self.reservation == "max_new_tokens" else self.block_size
        return min(prompt + more, self.max_seq_len)

    def needs(self, request: Request) -> dict[str, int]:
        positions = self.positions(request)
        return {p.name: p.tokens_for(positions) for p in self.pools if request.speculative or not p.speculative_only}

    def check_ever_fits(self, request: Request) -> None:
        """Raise :class:`RequestTooLargeError` naming the pool a request can never fit in."""
        for pool in self.pools:
            need = self.needs(request).get(pool.name)
            capacity = pool.capacity_tokens()
            if need is not None and capacity is not None and need > capacity:
                raise RequestTooLargeError(pool.name, need, capacity - self._totals[pool.name], capacity)

    def shortfall(self, request: Request) -> PoolExhaustedError | None:
        """The error naming the first pool the request does not fit in now, or None."""
        for pool in self.pools:
            need = self.needs(request).get(pool.name)
            capacity = pool.capacity_tokens()
            if need is None or capacity is None:
                continue
            free = capacity - self._totals[pool.name]
            if need > free:
                return PoolExhaustedError(pool.name, need, free, capacity)
        return None

    def try_reserve(self, request: Request) -> PoolExhaustedError | None:
        """Reserve the request's tokens in every pool it uses; on a shortfall reserve nothing and return it."""
        error = self.shortfall(request)
        if error is None:
            needs = self.needs(request)
            self._reserved[request.request_id] = needs
            for name, tokens in needs.items():
                self._totals[name] += tokens
        return error

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def unreserve(self, request_id: str) -> None:
        """Give back a finished request's reservations (idempotent)."""
        for name, tokens in self._reserved.pop(request_id, {}).items():
            self._totals[name] -= tokens

    def free_tokens(self) -> dict[str, int | None]:
        """Per pool: tokens not reserved by an admitted request (None: unbounded)."""
        out = {}
        for pool in self.pools:
            capacity = pool.capacity_tokens()
            out[pool.name] = None if capacity is None else capacity - self._totals[pool.name]
        return out

    def reserved_tokens(self) -> dict[str, int]:
        return dict(self._totals)
