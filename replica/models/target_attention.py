"""The target's gated full-attention layer and what its layers share within one forward_step.

``StepContext``: RoPE, the K/V buffers (contiguous layout) or the paged pool's slots and block
table (``PagedContext``, paged layout), the mask. ``Attention``: q/k RMSNorm per head, partial
RoPE, an optional sigmoid output gate (Qwen3.5), SDPA with GQA over the committed plus new keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspine import faults

from .row_packing import RowPacking
from .target_config import TargetArgs
from .target_layers import RMSNorm


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] channels. x (B, H, T, D); cos, sin (B, 1, T, R)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class StepContext:
    """What the full-attention layers of one forward_step share: RoPE, the K/V buffers, the mask."""

    def __init__(self, cos, sin, k_buf, v_buf, starts, positions, key_len, mask, uniform_start):
        self.cos, self.sin = cos, sin  # (B, 1, T, R)
        self.k_buf, self.v_buf = k_buf, v_buf  # (Lf, B, Hkv, S, D)
        self.starts = starts  # list[int] committed length per request
        self.positions = positions  # (B, T) absolute positions of the new tokens
        self.key_len = key_len  # keys [0, key_len) are read
        self.mask = mask  # (B, 1, T, key_len) bool, or None (single request, T == 1)
        self.uniform_start = uniform_start  # all requests have the same committed length
        self.paged: PagedContext | None = None  # paged layout, else None (contiguous / stateless)


class PagedContext:
    """Paged layout: where this step's new rows go and how attention reads the pool."""

    def __init__(self, pool, new_slots, valid, block_table, starts, read_slots, backend):
        self.pool = pool
        self.new_slots = new_slots  # [N] int64 flat slots of the valid new rows, (b, t) row-major
        self.valid = valid  # [B, T] bool, or None (every row is real)
        self.block_table = block_table  # [B, W] int32, padded with the sink block
        self.starts = starts  # [B] int32 committed length per request (device)
        self.read_slots = read_slots  # [B, key_len] int64 for the CPU gather, or None (in-place kernels)
        self.backend = backend  # "torch" | "triton" | "flash"


class Attention(nn.Module):
    def __init__(self, args: TargetArgs):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.gated = args.attn_output_gate
        q_out = self.n_head * self.head_dim * (2 if self.gated else 1)
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, args.zero_centred_norm)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, args.zero_centred_norm)

    def forward(self, x: torch.Tensor, ctx: StepContext, idx: int, packing: RowPacking) -> torch.Tensor:
        """x [N, H]: the step's real rows, packed by ``packing``; the projections run on them, RoPE
        and attention on the padded [B, T] grid. Returns [N, H]."""
        B, T = packing.batch, packing.width
        N = x.shape[0]
        D = self.head_dim
        q = self.q_proj(x)
        gate = None
        if self.gated:  # per head: [query (D) | gate (D)]
            q, gate = q.view(N, self.n_head, 2 * D).chunk(2, dim=-1)
            gate = gate.reshape(N, self.n_head * D)
        q = packing.pad(self.q_norm(q.reshape(N, self.n_head, D))).transpose(1, 2)  # (B, Hq, T, D)
        k = packing.pad(self.k_norm(self.k_proj(x).view(N, self.n_kv, D))).transpose(1, 2)  # (B, Hkv, T, D)
        v = packing.pad(self.v_proj(x).view(N, self.n_kv, D)).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)

        if ctx.paged is not None:
            return self._paged(q, k, v, ctx, idx, gate, packing)
        if ctx.k_buf is None:  # stateless (training): the keys are exactly the new tokens
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head)
            return self._output(y, gate, packing)
        k_buf, v_buf = ctx.k_buf[idx], ctx.v_buf[idx]  # (B, Hkv, S, D)
        if ctx.uniform_start:
            n = ctx.starts[0]
            k_buf[:, :, n : n + T] = k
            v_buf[:, :, n : n + T] = v
        else:
            b_idx = torch.arange(B, device=x.device)[:, None].expand(B, T)
            k_buf[b_idx, :, ctx.positions] = k.transpose(1, 2)  # indexed view is (B, T, Hkv, D)
            v_buf[b_idx, :, ctx.positions] = v.transpose(1, 2)
        keys, values = k_buf[:, :, : ctx.key_len], v_buf[:, :, : ctx.key_len]  # (B, Hkv, S, D)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=ctx.mask, enable_gqa=self.n_kv != self.n_head)
        return self._output(y, gate, packing)

    def _paged(self, q, k, v, ctx: "StepContext", idx: int, gate, packing: RowPacking):
        """q (B, Hq, T, D); k, v (B, Hkv, T, D): store the new rows in the pool, attend over it."""
        B, _, T, D = q.shape
        p = ctx.paged
        k_rows, v_rows = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, Hkv, D)
        slots = p.new_slots
        if p.valid is None or faults.active("paged_kv.write_padded_rows"):
            k_rows, v_rows = k_rows.reshape(B * T, self.n_kv, D), v_rows.reshape(B * T, self.n_kv, D)
            if p.valid is not None:
                slots = p.pool.slots(p.block_table, ctx.positions).reshape(-1)
        else:  # padded rows never reach the pool
            k_rows, v_rows = k_rows[p.valid], v_rows[p.valid]
        p.pool.write(idx, slots, k_rows, v_rows)
        if p.read_slots is not None:  # CPU: transient gather, then exactly the contiguous layout's SDPA
            keys, values = p.pool.gather(idx, p.read_slots)  # (B, Hkv, key_len, D)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=ctx.mask,
                                               enable_gqa=self.n_kv != self.n_head)
        else:  # CUDA: the pool is read in place
            from dspine.kernels.paged_attention import paged_attention

            y = paged_attention(q.transpose(1, 2), p.pool.layer_k(idx), p.pool.layer_v(idx), p.block_table,
                                p.starts, D**-0.5, backend=p.backend).transpose(1, 2)
        return self._output(y, gate, packing)

    def _output(self, y: torch.Tensor, gate: torch.Tensor | None, packing: RowPacking) -> torch.Tensor:
        # y: [B, Hq, T, D]; gate: [N, Hq * D] or None -> [N, H]
        B, _, T, D = y.size()
        y = packing.pack(y.transpose(1, 2).reshape(B, T, self.n_head * D))  # (N, Hq * D)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.o_proj(y)
