"""DSpine bridge: read a feature code per row, write a gated predecessor message into the next row.

Per row t of a block (x of width H; D code width, M message width):

    r_t  = sqrt(mean(x_t^2))
    z_t  = R (x_t / (r_t + eps))                 R [D, H], one per layer
    c_t  = sqrt(D) z_t / (|z_t| + eps)           anchor (t = 0): c_0 = sqrt(D) codebook[anchor]
    m_t  = sigmoid(G c_t + Gp c_{t-1} + b) * (A c_{t-1})      G, Gp, A [M, D], b [M]
    x'_t = x_t + r_t W m_t   (t >= 1),   x'_0 = x_0            W [H, M], one per layer

Launches of `bridge_triton` (5): the three projections stay cuBLAS matmuls
(`x R^T`, `c [G; Gp; A]^T`, and `addmm(x, r*m, W^T)` which does the
RMS-scaled residual write), and two Triton kernels do everything else:
`_bridge_read_kernel` (RMS, the 1/(r+eps) scale, code norm, anchor codebook
gather) and `_bridge_message_kernel` (gates, sigmoid, message, the r_t scale
and the anchor mask). Since R is linear, R(x/(r+eps)) = (R x)/(r+eps), so the
read matmul runs on raw x and the scale is applied in the kernel.

`codes` and `rms` come back in fp32 for the tail.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._triton import USE_TRITON as _USE_TRITON, tl, triton


class BridgeOut(NamedTuple):
    x_out: torch.Tensor  # [NB, BS, H] x.dtype: x after the write
    codes: torch.Tensor  # [NB, BS, D] fp32 (fp64 for fp64 x): c_t (anchor rows: sqrt(D) codebook[anchor])
    rms: torch.Tensor  # [NB, BS] fp32 (fp64 for fp64 x): r_t


if triton is not None:

    @triton.jit
    def _bridge_read_kernel(
        x_ptr,  # [N, H] x, N = NB * BS rows
        zraw_ptr,  # [N, D] R x (raw, not yet divided by r + eps)
        anchor_ids_ptr,  # [NB] int64
        codebook_ptr,  # [V, D]
        codes_ptr,  # [N, D] fp32 out
        rms_ptr,  # [N] fp32 out
        eps,
        sqrt_d,  # sqrt(D)
        H: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # No runtime-varying scalar arguments: the batch size only changes the grid,
        # so do_not_specialize is empty.
        i_row = tl.program_id(0).to(tl.int64)
        o_h = tl.arange(0, BLOCK_H)
        b_ss = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            m_h = h0 + o_h < H
            b_x = tl.load(x_ptr + i_row * H + h0 + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_ss += b_x * b_x
        b_r = tl.sqrt(tl.sum(b_ss, axis=0) / H)
        tl.store(rms_ptr + i_row, b_r)

        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        is_anchor = (i_row % BS) == 0
        if is_anchor:
            i_tok = tl.load(anchor_ids_ptr + i_row // BS).to(tl.int64)
            b_c = sqrt_d * tl.load(codebook_ptr + i_tok * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        else:
            b_z = tl.load(zraw_ptr + i_row * D + o_d, mask=m_d, other=0.0).to(tl.float32) / (b_r + eps)
            b_n = tl.sqrt(tl.sum(b_z * b_z, axis=0))
            b_c = sqrt_d * b_z / (b_n + eps)
        tl.store(codes_ptr + i_row * D + o_d, b_c, mask=m_d)

    @triton.jit
    def _bridge_message_kernel(
        proj_ptr,  # [N, 3M] per row: [G c_t | Gp c_t | A c_t]
        gate_bias_ptr,  # [M]
        rms_ptr,  # [N] fp32
        msg_ptr,  # [N, M] out: r_t * m_t (0 on anchor rows), in the write matrix's dtype
        M: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        i_row = tl.program_id(0).to(tl.int64)
        o_m = tl.arange(0, BLOCK_M)
        m_m = o_m < M
        is_anchor = (i_row % BS) == 0
        if is_anchor:  # anchor mask: nothing crosses from the previous request's block
            b_msg = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            p_prev = proj_ptr + (i_row - 1) * 3 * M
            b_g = tl.load(proj_ptr + i_row * 3 * M + o_m, mask=m_m, other=0.0).to(tl.float32)
            b_gp = tl.load(p_prev + M + o_m, mask=m_m, other=0.0).to(tl.float32)
            b_a = tl.load(p_prev + 2 * M + o_m, mask=m_m, other=0.0).to(tl.float32)
            b_b = tl.load(gate_bias_ptr + o_m, mask=m_m, other=0.0).to(tl.float32)
            b_r = tl.load(rms_ptr + i_row)
            b_msg = b_r * tl.sigmoid(b_g + b_gp + b_b) * b_a
        tl.store(msg_ptr + i_row * M + o_m, b_msg.to(msg_ptr.dtype.element_ty), mask=m_m)


def _check(x, anchor_ids, codebook, read_proj, gate_recv, gate_pred, value_proj, gate_bias, write_proj):
    if x.dim() != 3:
        raise ValueError(f"x must be [NB, BS, H], got shape {tuple(x.shape)}")
    NB, BS, H = x.shape
    D, M = read_proj.shape[0], gate_recv.shape[0]
    expected = {
        "anchor_ids": (anchor_ids, (NB,)), "codebook": (codebook, (codebook.shape[0], D)),
        "read_proj": (read_proj, (D, H)), "gate_recv": (gate_recv, (M, D)), "gate_pred": (gate_pred, (M, D)),
        "value_proj": (value_proj, (M, D)), "gate_bias": (gate_bias, (M,)), "write_proj": (write_proj, (H, M)),
    }
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"bridge: {name} has shape {tuple(t.shape)}, expected {shape}")
    return NB, BS, H, D, M


def bridge_triton(x, anchor_ids, codebook, read_proj, gate_recv, gate_pred, value_proj, gate_bias,
                  write_proj, eps: float) -> BridgeOut:
    NB, BS, H, D, M = _check(x, anchor_ids, codebook, read_proj, gate_recv, gate_pred, value_proj,
                             gate_bias, write_proj)
    N = NB * BS
    x2 = x.reshape(N, H).contiguous()
    wdt = read_proj.dtype
    zraw = (x2.to(wdt) @ read_proj.t()).contiguous()  # [N, D]
    codes = torch.empty(N, D, dtype=torch.float32, device=x.device)
    rms = torch.empty(N, dtype=torch.float32, device=x.device)
    _bridge_read_kernel[(N,)](
        x2, zraw, anchor_ids.contiguous(), codebook.contiguous(), codes, rms, float(eps), math.sqrt(D),
        H=H, D=D, BS=BS, BLOCK_H=min(1024, triton.next_power_of_2(H)), BLOCK_D=triton.next_power_of_2(D),
    )
    gdt = gate_recv.dtype
    proj = (codes.to(gdt) @ torch.cat([gate_recv, gate_pred, value_proj], 0).t()).contiguous()  # [N, 3M]
    msg = torch.empty(N, M, dtype=write_proj.dtype, device=x.device)
    _bridge_message_kernel[(N,)](
        proj, gate_bias.contiguous(), rms, msg, M=M, BS=BS, BLOCK_M=triton.next_power_of_2(M),
    )
    x_out = torch.addmm(x2.to(write_proj.dtype), msg, write_proj.t()).to(x.dtype)  # x + (r m) W^T
    return BridgeOut(x_out.view(NB, BS, H), codes.view(NB, BS, D), rms.view(NB, BS))


def bridge_ref(x, anchor_ids, codebook, read_proj, gate_recv, gate_pred, value_proj, gate_bias,
               write_proj, eps: float) -> BridgeOut:
    NB, BS, H, D, M = _check(x, anchor_ids, codebook, read_proj, gate_recv, gate_pred, value_proj,
                             gate_bias, write_proj)
    f = torch.promote_types(x.dtype, torch.float32)  # fp32 maths (fp64 for fp64 inputs)
    xf = x.to(f)
    r = xf.pow(2).mean(-1).sqrt()  # [NB, BS]
    z = (xf / (r[..., None] + eps)) @ read_proj.to(f).t()  # [NB, BS, D]
    c = math.sqrt(D) * z / (z.norm(dim=-1, keepdim=True) + eps)
    c = torch.cat([math.sqrt(D) * codebook[anchor_ids].to(f)[:, None], c[:, 1:]], dim=1)
    prev = c[:, :-1]  # c_{t-1} for t = 1..BS-1
    gate = torch.sigmoid(c[:, 1:] @ gate_recv.to(f).t() + prev @ gate_pred.to(f).t() + gate_bias.to(f))
    m = gate * (prev @ value_proj.to(f).t())  # [NB, BS-1, M]
    write = (r[:, 1:, None] * m) @ write_proj.to(f).t()  # [NB, BS-1, H]
    x_out = torch.cat([xf[:, :1], xf[:, 1:] + write], dim=1).to(x.dtype)
    return BridgeOut(x_out, c, r)


def bridge(x, anchor_ids, codebook, read_proj, gate_recv, gate_pred, value_proj, gate_bias,
           write_proj, eps: float) -> BridgeOut:
    """Dispatch: `bridge_triton` on CUDA tensors when Triton is available, else `bridge_ref`."""
    fn = bridge_triton if (_USE_TRITON and x.is_cuda) else bridge_ref
    return fn(x, anchor_ids, codebook, read_proj, gate_recv, gate_pred, value_proj, gate_bias, write_proj, eps)
