"""The target's paged K/V pool: one preallocated store for every full-attention layer of a replica.

Levels, top to bottom (the draft pool, `replica/draft_kv_pool.py`, is the model):

1. request -> blocks. Each request owns a block table: the pool blocks that
   hold its positions in order (position p lives in block table[p // block_size]
   at offset p % block_size). `reserve(rid, n)` makes the table cover n
   positions, `truncate(rid, n)` gives back the blocks wholly past n (a
   rollback of rejected verify rows: no K/V moves), `free_request` (finish,
   cancel, failure) gives back all of them.
2. block allocator. A free stack of block ids. Running out is explicit:
   `reserve` raises `TargetKVPoolExhausted` with counts. Misuse (unknown or
   duplicate request) is a bug: `ValueError`.
3. physical buffers. `k, v [layers, num_blocks, block_size, kv_heads, head_dim]`,
   flash-attn's paged layout (`flash_attn_with_kvcache(k_cache=k[l],
   block_table=...)`), allocated once. A step writes only its new rows
   (`write`), never copies K/V that already exists.

Block 0 is the padding sink: padded block-table entries point at it (a padded
query row of a ragged batch may read there; its result is discarded), and it
is never handed to a request. `capacity_blocks = num_blocks - 1`.

Counters (`bytes_written`, `bytes_gathered`) let tests and benches see what a
step moved: writes are the step's new rows; gathers are the CPU attention
path's transient per-layer copies (`gather`), counted apart because the GPU
paths read the pool in place.
"""
from __future__ import annotations

import logging
from typing import Hashable, Sequence

import torch

from dspine import faults
from dspine.replica.errors import DSpineError

logger = logging.getLogger(__name__)

SINK_BLOCK = 0  # reserved padding sink, never allocated


class TargetKVPoolExhausted(DSpineError, RuntimeError):
    """Not enough free target K/V blocks (-> RESOURCE_EXHAUSTED at the edge)."""

    def __init__(self, requested: int, free: int, capacity: int, block_size: int):
        super().__init__(
            f"target KV pool exhausted: {requested} blocks of {block_size} tokens requested, {free} free "
            f"of {capacity}; finish or cancel requests, or size the pool larger (target_kv_blocks)"
        )
        self.requested = requested
        self.free = free
        self.capacity = capacity
        self.block_size = block_size

    def __reduce__(self):  # crosses process boundaries (Ray) with its arguments
        return type(self), (self.requested, self.free, self.capacity, self.block_size)


class _Table:
    """One request's blocks: a CPU list (allocation) mirrored in a device int32 tensor (addressing)."""

    __slots__ = ("blocks", "device_table")

    def __init__(self, device):
        self.blocks: list[int] = []
        self.device_table = torch.zeros(16, dtype=torch.int32, device=device)


class PagedKVPool:
    """Paged K/V store for the target's full-attention layers (see the module docstring)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, device="cpu", dtype: torch.dtype = torch.float32):
        if num_blocks < 2:
            raise ValueError(f"target_kv_blocks: {num_blocks} must be >= 2 (block 0 is the padding sink)")
        if block_size < 1:
            raise ValueError(f"target_kv_block_size: must be >= 1, got {block_size}")
        self.device, self.dtype = torch.device(device), dtype
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: a padded query row may read the sink or a stale slot, and must see finite values
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free = list(range(num_blocks - 1, 0, -1))  # stack; the top is the end; block 0 never on it
        self._tables: dict[Hashable, _Table] = {}
        self.peak = 0
        self.bytes_written = 0  # K and V bytes stored by `write`, all layers
        self.bytes_gathered = 0  # K and V bytes copied out by `gather` (CPU attention), all layers
        self.num_gathers = 0
        logger.info("PagedKVPool: %d blocks x %d tokens x %d B/token = %.1f MiB (%s, %s)", num_blocks, block_size,
                    self.bytes_per_token, 2 * self.k.numel() * self.k.element_size() / 2**20, dtype, self.device)

    # ------------------------------------------------------------------ sizing
    @property
    def bytes_per_token(self) -> int:
        """K and V of one position over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    @property
    def row_bytes(self) -> int:
        """K and V of one position in one layer (the unit `write` counts)."""
        return 2 * self.num_kv_heads * self.head_dim * self.k.element_size()

    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks held by requests (zero when idle: the leak check)."""
        return self.capacity_blocks - len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions."""
        return -(-max(int(num_tokens), 0) // self.block_size)

    # ------------------------------------------------------------------ requests
    def alloc_request(self, request_id: Hashable) -> None:
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds target KV blocks")
        self._tables[request_id] = _Table(self.device)

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._tables

    def free_request(self, request_id: Hashable) -> int:
        """Return every block of the request; idempotent (unknown ids free nothing). Returns blocks freed."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return 0
        if faults.active("paged_kv.free_keeps_blocks"):
            return 0
        self._free.extend(reversed(table.blocks))
        return len(table.blocks)

    def request_blocks(self, request_id: Hashable) -> int:
        return len(self._table(request_id).blocks)

    def _table(self, request_id) -> _Table:
        try:
            return self._tables[request_id]
        except KeyError:
            raise ValueError(f"request {request_id!r} has no target KV blocks; call alloc_request first") from None

    # ------------------------------------------------------------------ allocation
    def reserve_many(self, request_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> None:
        """Make each request's table cover its `num_tokens` positions; all or nothing."""
        tables = [self._table(r) for r in request_ids]
        extra = [max(0, self.blocks_needed(n) - len(t.blocks)) for t, n in zip(tables, num_tokens, strict=True)]
        need = sum(extra)
        if need > len(self._free):
            raise TargetKVPoolExhausted(need, len(self._free), self.capacity_blocks, self.block_size)
        for t, e in zip(tables, extra):
            if not e:
                continue
            new = [self._free.pop() for _ in range(e)]
            start = len(t.blocks)
            t.blocks.extend(new)
            if len(t.blocks) > t.device_table.numel():
                grown = torch.zeros(max(2 * t.device_table.numel(), len(t.blocks)), dtype=torch.int32,
                                    device=self.device)
                grown[:start] = t.device_table[:start]
                t.device_table = grown
            t.device_table[start: len(t.blocks)] = torch.tensor(new, dtype=torch.int32).to(self.device)
        self.peak = max(self.peak, self.used)

    def reserve(self, request_id: Hashable, num_tokens: int) -> None:
        self.reserve_many([request_id], [num_tokens])

    def truncate(self, request_id: Hashable, num_tokens: int) -> int:
        """Give back the blocks wholly past `num_tokens` positions (no K/V moves). Returns blocks freed."""
        t = self._table(request_id)
        keep = self.blocks_needed(num_tokens)
        dropped = t.blocks[keep:]
        if dropped:
            del t.blocks[keep:]
            self._free.extend(reversed(dropped))
        return len(dropped)

    # ------------------------------------------------------------------ addressing
    def block_table(self, request_ids: Sequence[Hashable], width: int | None = None) -> torch.Tensor:
        """[B, width] int32 (device): each request's blocks, padded with the sink block."""
        tables = [self._table(r) for r in request_ids]
        width = max((len(t.blocks) for t in tables), default=1) if width is None else width
        out = torch.full((len(tables), max(width, 1)), SINK_BLOCK, dtype=torch.int32, device=self.device)
        for b, t in enumerate(tables):
            n = min(len(t.blocks), width)
            if n:
                out[b, :n] = t.device_table[:n]
        return out

    def slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot ids (block * block_size + offset), int64, shaped like positions [B, ...]."""
        # block_table: [B, W] int32; positions: [B, N] int64, each < W * block_size
        blocks = block_table.long().gather(1, positions.div(self.block_size, rounding_mode="floor"))
        return blocks * self.block_size + positions.remainder(self.block_size)

    # ------------------------------------------------------------------ data
    def layer_k(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, Hkv, D]
        return self.k[layer]

    def layer_v(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, Hkv, D]
        return self.v[layer]

    def write(self, layer: int, slots: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """Store new rows in place. slots [N] int64; k_rows, v_rows [N, Hkv, D]."""
        flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, slots, k_rows.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slots, v_rows.to(self.dtype))
        self.bytes_written += slots.numel() * self.row_bytes

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Transient copies for the CPU attention path. slots [B, S] -> (k, v) [B, Hkv, S, D]."""
        flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        k = self.k[layer].view(flat)[slots].transpose(1, 2)
        v = self.v[layer].view(flat)[slots].transpose(1, 2)
        self.bytes_gathered += slots.numel() * self.row_bytes
        self.num_gathers += 1
        return k, v

    def reset_counters(self) -> None:
        self.bytes_written = self.bytes_gathered = self.num_gathers = 0

    def stats(self) -> dict:
        return {"used_blocks": self.used, "peak_blocks": self.peak, "capacity_blocks": self.capacity_blocks,
                "block_size": self.block_size, "requests": len(self._tables),
                "bytes_written": self.bytes_written, "bytes_gathered": self.bytes_gathered}


def build_target_kv_pool(target, config, max_seq_len: int, lookahead: int, device) -> PagedKVPool | None:
    """The replica's pool per `EngineConfig` (None: contiguous layout, or a target without full attention).
    `lookahead`: rows a step may write past a request's final length (the verify block)."""
    if config.target_kv_layout != "paged" or not target.args.full_layer_ids:
        return None
    block = config.target_kv_block_size
    per_request = -(-(max_seq_len + max(lookahead, 1)) // block)
    num_blocks = config.target_kv_blocks
    if num_blocks is None and config.target_kv_tokens is not None:  # admission's bound, in whole blocks
        num_blocks = -(-config.target_kv_tokens // block) + 1
    if num_blocks is None:
        num_blocks = config.max_concurrency * per_request + 1
    return target.new_kv_pool(num_blocks, block, device=device, dtype=next(target.parameters()).dtype)
