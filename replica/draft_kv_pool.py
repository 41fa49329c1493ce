"""The DSpine drafter's K/V pool: fused-context K/V, one entry per committed position.

Levels, top to bottom:

1. request -> slots. Each request owns the list of pool slots holding its
   context positions in position order (`context_slots`), and its absolute
   position count (`num_positions`, which RoPE uses).
2. slot allocator. A free stack of slot ids. `append` takes slots,
   `free_request` (on finish, cancel or error) gives them back. Running out is
   explicit: `append` raises `DraftPoolExhausted` with counts, `try_append`
   returns None ("try later"). Misuse (unknown or duplicate request) is a bug:
   `ValueError`.
3. physical buffers. One preallocated tensor `kv [layers, 2, num_slots,
   kv_heads, head_dim]` (BF16 by default on CUDA): `kv[l, 0]` is layer l's K,
   `kv[l, 1]` its V, already RoPE-rotated at their absolute positions.

Slot 0 is reserved as the padding sink: padded entries of `context_slots`
point at it, and writes that must go nowhere (ring positions evicted before
they were ever read) land there. It is never handed to a request.

`DraftKVPool` is dense: a request holds one slot per position it has ever
appended (the released plugin's behaviour: the 8,192 window bounds reads, not
storage). `RingDraftKVPool` holds at most `window` slots per request and reuses
the oldest; absolute positions keep counting, so RoPE and the window mask stay
right. The attention mask only depends on position differences, so a ring's
`context_slots` (the last <= window positions) drafts exactly like the dense
pool's full list.
"""
from __future__ import annotations

import logging
from typing import Hashable, Sequence

import torch

from dspine.replica.errors import DraftPoolExhausted  # noqa: F401  (raised here; importable from here as before)
from dspine.replica.models.dspine_config import DraftArgs

logger = logging.getLogger(__name__)

PADDING_SLOT = 0  # reserved padding sink, never allocated


class _Seq:
    """Per-request slot table (device int64, grows by doubling) and position count."""

    __slots__ = ("table", "held", "positions")

    def __init__(self, device):
        self.table = torch.zeros(16, dtype=torch.int64, device=device)
        self.held = 0  # slots owned (dense: == positions; ring: <= window)
        self.positions = 0  # absolute positions appended so far


class DraftKVPool:
    """Dense token-to-KV pool for the drafter (see the module docstring)."""

    def __init__(self, args: DraftArgs, num_slots: int, device="cpu", dtype: torch.dtype | None = None):
        if num_slots < 2:
            raise ValueError(f"num_slots {num_slots} must be >= 2 (slot 0 is the padding sink)")
        device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.args = args
        self.device, self.dtype = device, dtype
        self.num_slots = num_slots
        # [layers, 2 (K, V), num_slots, kv_heads, head_dim]
        self.kv = torch.zeros(args.num_layers, 2, num_slots, args.num_kv_heads, args.head_dim,
                              dtype=dtype, device=device)
        # free stack (CPU): the top is _free[_num_free - 1]; slot 0 is never on it
        self._free = torch.arange(num_slots - 1, 0, -1, dtype=torch.int64)
        self._num_free = num_slots - 1
        self._seqs: dict[Hashable, _Seq] = {}
        self.peak = 0
        logger.info("%s: %d slots x %d B = %.1f MiB (%s, %s)", type(self).__name__, num_slots,
                    self.bytes_per_slot(args, dtype), self.kv.numel() * self.kv.element_size() / 2**20,
                    dtype, device)

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def bytes_per_slot(args: DraftArgs, dtype: torch.dtype = torch.bfloat16) -> int:
        return 2 * args.num_layers * args.num_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_budget(cls, args: DraftArgs, budget_bytes: int, device="cpu", dtype=None, **kw) -> "DraftKVPool":
        dt = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        return cls(args, max(2, budget_bytes // cls.bytes_per_slot(args, dt)), device, dtype, **kw)

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def used(self) -> int:
        return self.capacity - self._num_free

    @property
    def num_free(self) -> int:
        return self._num_free

    def k(self, layer: int) -> torch.Tensor:  # [num_slots, kv_heads, head_dim]
        return self.kv[layer, 0]

    def v(self, layer: int) -> torch.Tensor:  # [num_slots, kv_heads, head_dim]
        return self.kv[layer, 1]

    # ------------------------------------------------------------------ requests
    def alloc_request(self, request_id: Hashable) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already holds draft KV slots")
        self._seqs[request_id] = _Seq(self.device)

    def free_request(self, request_id: Hashable) -> int:
        """Return every slot of the request; idempotent (unknown ids free nothing). Returns slots freed."""
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.held == 0:
            return 0
        slots = seq.table[: seq.held].cpu()
        self._free[self._num_free: self._num_free + seq.held] = slots
        self._num_free += seq.held
        return seq.held

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._seqs

    def request_len(self, request_id: Hashable) -> int:
        """Slots the request holds now (dense: its positions; ring: at most window)."""
        return self._seq(request_id).held

    def num_positions(self, request_id: Hashable) -> int:
        """Absolute positions appended so far (the next position's index)."""
        return self._seq(request_id).positions

    def positions(self, request_ids: Sequence[Hashable]) -> torch.Tensor:
        """[NB] int64 (device): absolute context length of each request (its block's anchor position)."""
        return torch.tensor([self._seq(r).positions for r in request_ids], dtype=torch.int64, device=self.device)

    def _seq(self, request_id) -> _Seq:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise ValueError(f"request {request_id!r} has no draft KV slots; call alloc_request first") from None

    # ------------------------------------------------------------------ allocation
    def _new_slots_needed(self, seq: _Seq, n: int) -> int:
        return n

    def _take(self, n: int) -> torch.Tensor:
        out = self._free[self._num_free - n: self._num_free].flip(0).to(self.device)
        self._num_free -= n
        self.peak = max(self.peak, self.used)
        return out

    def _place(self, seq: _Seq, n: int) -> torch.Tensor:
        slots = self._take(n)
        if seq.held + n > seq.table.numel():
            grown = torch.zeros(max(2 * seq.table.numel(), seq.held + n), dtype=torch.int64, device=self.device)
            grown[: seq.held] = seq.table[: seq.held]
            seq.table = grown
        seq.table[seq.held: seq.held + n] = slots
        seq.held += n
        seq.positions += n
        return slots

    def try_append(self, request_id: Hashable, n: int) -> torch.Tensor | None:
        """Slots [n] int64 for the request's next n positions, or None if the pool is full (try later)."""
        seq = self._seq(request_id)
        if n < 0:
            raise ValueError(f"cannot append {n} positions")
        if self._new_slots_needed(seq, n) > self._num_free:
            return None
        return self._place(seq, n)

    def append(self, request_id: Hashable, n: int) -> torch.Tensor:
        """Slots [n] int64 (device) for the request's next n positions; raises DraftPoolExhausted."""
        slots = self.try_append(request_id, n)
        if slots is None:
            raise DraftPoolExhausted(self._new_slots_needed(self._seq(request_id), n), self._num_free, self.capacity)
        return slots

    def append_many(self, request_ids: Sequence[Hashable], counts: Sequence[int]) -> list[torch.Tensor]:
        """`append` for several requests, all or nothing (checks the total first)."""
        need = sum(self._new_slots_needed(self._seq(r), n) for r, n in zip(request_ids, counts, strict=True))
        if need > self._num_free:
            raise DraftPoolExhausted(need, self._num_free, self.capacity)
        return [self._place(self._seq(r), n) for r, n in zip(request_ids, counts)]

    def can_append(self, request_ids: Sequence[Hashable], counts: Sequence[int]) -> bool:
        return sum(self._new_slots_needed(self._seq(r), n) for r, n in zip(request_ids, counts)) <= self._num_free

    # ------------------------------------------------------------------ reads
    def _ordered(self, seq: _Seq) -> torch.Tensor:
        return seq.table[: seq.held]

    def context_slots(self, request_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [NB, Lmax] int64 padded with slot 0, lens [NB] int64), both on the pool's device.

        Row n lists the slots of the positions request n holds, oldest first; for
        the dense pool that is every position, for the ring the last <= window.
        """
        seqs = [self._seq(r) for r in request_ids]
        lmax = max((s.held for s in seqs), default=0)
        slots = torch.full((len(seqs), max(lmax, 1)), PADDING_SLOT, dtype=torch.int64, device=self.device)
        for i, s in enumerate(seqs):
            if s.held:
                slots[i, : s.held] = self._ordered(s)
        lens = torch.tensor([s.held for s in seqs], dtype=torch.int64, device=self.device)
        return slots, lens

    def stats(self) -> dict:
        return {"used": self.used, "peak": self.peak, "capacity": self.capacity, "requests": len(self._seqs)}


class RingDraftKVPool(DraftKVPool):
    """Bounded variant: a request holds at most `window` slots; position p lives in ring[p % window].

    A position that would be overwritten within the same `append` (n > window)
    gets the padding slot, so its K/V write lands in the sink.
    """

    def __init__(self, args: DraftArgs, num_slots: int, device="cpu", dtype=None, window: int | None = None):
        self.window = int(window or args.window)
        super().__init__(args, num_slots, device, dtype)

    def _new_slots_needed(self, seq: _Seq, n: int) -> int:
        return max(0, min(seq.held + n, self.window) - seq.held)

    def _place(self, seq: _Seq, n: int) -> torch.Tensor:
        w = self.window
        new = self._new_slots_needed(seq, n)
        if new:
            if seq.table.numel() < w:
                grown = torch.zeros(w, dtype=torch.int64, device=self.device)
                grown[: seq.held] = seq.table[: seq.held]
                seq.table = grown
            seq.table[seq.held: seq.held + new] = self._take(new)
            seq.held += new
        pos = torch.arange(seq.positions, seq.positions + n, device=self.device)
        slots = seq.table[pos % w]
        # positions overwritten by a later one of this same append write into the sink
        slots = torch.where(pos < seq.positions + n - w, torch.full_like(slots, PADDING_SLOT), slots)
        seq.positions += n
        return slots

    def _ordered(self, seq: _Seq) -> torch.Tensor:
        if seq.positions <= self.window:
            return seq.table[: seq.held]
        return torch.roll(seq.table[: self.window], -(seq.positions % self.window))
