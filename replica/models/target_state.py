"""Per-request state of the target model: `TargetState`, and the step output.

- One `TargetState` per request, created by `TargetModel.new_state()`.
  Committed positions [0, num_tokens) are final; a `forward_step` adds
  `num_pending` positions on top, which `TargetModel.commit()` then keeps in
  part (the first k) and drops in part.
- Full-attention layers, one of two layouts:
  paged (`kv_pool` set): the request's blocks in the replica's `PagedKVPool`
  (`paged_kv_pool.py`), addressed by `kv_id`; contiguous (the original
  layout, kept selectable): per-request buffers `[Lf, Hkv, capacity, D]`,
  grown by doubling. Either way pending K/V are written at [num_tokens,
  num_tokens + T); dropping them only means not advancing `num_tokens` (later
  writes overwrite; the paged layout also gives back blocks wholly past it).
- Gated DeltaNet layers: committed conv state `[Ll, C, K-1]` and recurrent
  state `[Ll, Hv, Dk, Dv]` (always fp32) are never touched by a step. The
  step leaves beside them the state after all its tokens (`pending_conv`,
  `pending_recurrent`) and, for steps of at most `max_replay_tokens` tokens,
  the per-position recurrence inputs (`ReplayInputs`). `commit(k)` takes the
  final state when k == T, else replays k recurrence steps from the committed
  state (cheap: no projections, batched over requests and layers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReplayInputs:
    """Per-position GDN inputs of the pending positions of one request (all GDN layers)."""

    conv_in: torch.Tensor  # [Ll, T, C] pre-conv projections (model dtype)
    key: torch.Tensor  # [Ll, T, Hv, Dk] fp32, l2-normalised, repeated to value heads
    value: torch.Tensor  # [Ll, T, Hv, Dv] fp32
    log_decay: torch.Tensor  # [Ll, T, Hv] fp32 (g: the state is scaled by exp(g))
    beta: torch.Tensor  # [Ll, T, Hv] fp32


@dataclass
class TargetState:
    """Everything the target remembers about one request."""

    num_tokens: int = 0  # committed length
    num_pending: int = 0  # positions added by the last forward_step, not yet committed
    k_cache: torch.Tensor | None = None  # [Lf, Hkv, capacity, D]
    v_cache: torch.Tensor | None = None  # [Lf, Hkv, capacity, D]
    kv_pool: object | None = None  # PagedKVPool holding this request's K/V blocks (paged layout)
    kv_id: object | None = None  # the request's key in kv_pool
    conv_state: torch.Tensor | None = None  # [Ll, C, K-1] committed (model dtype)
    recurrent: torch.Tensor | None = None  # [Ll, Hv, Dk, Dv] committed (fp32)
    pending_conv: torch.Tensor | None = None  # [Ll, C, K-1] after all pending positions
    pending_recurrent: torch.Tensor | None = None  # [Ll, Hv, Dk, Dv] after all pending positions
    replay: ReplayInputs | None = None  # per-position inputs of the pending positions (T <= max_replay_tokens)

    @property
    def capacity(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[2]

    def ensure_capacity(self, needed: int) -> None:
        """Grow the K/V buffers (doubling) so that `needed` positions fit."""
        if self.k_cache is None or needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity, 16)
        for name in ("k_cache", "v_cache"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self.num_tokens] = old[:, :, : self.num_tokens]
            setattr(self, name, new)

    def clear_pending(self) -> None:
        self.num_pending = 0
        self.pending_conv = self.pending_recurrent = None
        self.replay = None

    def free(self) -> None:
        """Free every tensor and K/V block; the state must not be used afterwards."""
        self.clear_pending()
        if self.kv_pool is not None:
            self.kv_pool.free_request(self.kv_id)
            self.kv_pool = None
        self.k_cache = self.v_cache = self.conv_state = self.recurrent = None
        self.num_tokens = 0

    def nbytes(self) -> int:
        tensors = [self.k_cache, self.v_cache, self.conv_state, self.recurrent,
                   self.pending_conv, self.pending_recurrent]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class StepOutput:
    """Result of `TargetModel.forward_step`."""

    logits: torch.Tensor | None  # [B, T, V] fp32 (padding past T_b); [B, 1, V] with logits="last"; None: "none"
    features: torch.Tensor | None  # [B, T, F, H] hidden state after each requested tap layer
    num_new: list[int]  # T_b per request
