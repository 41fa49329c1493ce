"""Where one forward_step's real rows sit in its padded [B, T] grid.

A step's requests bring different numbers of new rows (a verify of 16 rows beside riders of one).
The per-row work (norms, projections, MLPs, the LM head) runs on the N real rows only, packed in
(request, position) row-major order; only the sequence mixers (attention, the delta rule, the
conv) see the padded [B, T] grid. With 8 requests of which one verifies 16 rows, the GEMMs
compute 23 rows, not 128.
"""

from __future__ import annotations

import torch

from dspine import faults


class RowPacking:
    """Pack [B, T, ...] -> [N, ...] and pad back; the identity (a reshape) when every request has T rows."""

    def __init__(self, lens: list[int], valid: torch.Tensor | None):
        # valid: [B, T] bool, or None when every request brings T rows
        self.lens = lens
        self.batch = len(lens)
        self.width = max(lens)
        self.ragged = valid is not None and not faults.active("target.pad_rows_for_gemms")
        self.index = valid.reshape(-1).nonzero().squeeze(1) if self.ragged else None  # [N]

    def last_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, ...]: each request's last real row (what a prefill samples from)."""
        # built here, not per step: only a prefill's logits="last" asks for it
        lens = torch.tensor(self.lens, device=x.device)
        last = lens.cumsum(0) - 1 if self.ragged else torch.arange(self.batch, device=x.device) * self.width + lens - 1
        return x[last]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...] (N = B * T when not ragged)."""
        flat = x.reshape(self.batch * self.width, *x.shape[2:])
        return flat.index_select(0, self.index) if self.ragged else flat

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...], zeros at the padding."""
        if not self.ragged:
            return x.reshape(self.batch, self.width, *x.shape[1:])
        out = x.new_zeros(self.batch * self.width, *x.shape[1:])
        out = out.index_copy(0, self.index, x)
        return out.reshape(self.batch, self.width, *x.shape[1:])
