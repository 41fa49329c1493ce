"""Gated DeltaNet (linear attention) layer of the Qwen3.5 target, with explicit state.

- Projections as in the HF checkpoint: `in_proj_qkv` (H -> 2*Hk*Dk + Hv*Dv),
  `in_proj_z` (output gate), `in_proj_b` (beta), `in_proj_a` (decay), a
  depthwise causal `conv1d` over time (kernel K, SiLU), `A_log`, `dt_bias`,
  a gated RMSNorm per value head (`norm`, plain weight, SiLU(z) gate), `out_proj`.
- Gated delta rule, per value head, state S [Dk, Dv] (fp32):
      S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S
  with q, k l2-normalised, q scaled by Dk^-0.5, g = -exp(A_log) softplus(a + dt_bias),
  beta = sigmoid(b); each key head serves Hv / Hk consecutive value heads.
- A single-token decode step runs the recurrence directly; multi-token steps
  (verify, prefill) use the chunked form (`delta_rule_chunked`, 64 per chunk,
  a triangular solve per chunk).
  Padded positions (valid == False) get g = 0 and beta = 0, so they leave the
  state untouched.
- `delta_rule_replay` re-runs the recurrence from stored per-position inputs;
  `TargetModel.commit` uses it to take the state at an accepted prefix.
- On CUDA, flash-linear-attention and causal-conv1d run the delta rule and
  the conv when they import (`gdn_backend.py`); this torch code is their
  reference and the CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import gdn_backend
from .row_packing import RowPacking
from .target_config import TargetArgs


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step(state, key, value, log_decay, beta):
    """One gated delta-rule update. state [..., Dk, Dv]; key [..., Dk]; value [..., Dv]; log_decay, beta [...]."""
    state = state * log_decay.exp()[..., None, None]
    recalled = (key.unsqueeze(-2) @ state).squeeze(-2)  # [..., Dv]
    delta = (value - recalled) * beta[..., None]
    return state + key.unsqueeze(-1) * delta.unsqueeze(-2)


def delta_rule_chunked(query, key, value, log_decay, beta, state, chunk: int = 64):
    """Same result as T sequential `delta_rule_step`s, computed chunk by chunk (for long prefill).
    query, key (B, H, T, Dk); value (B, H, T, Dv); log_decay, beta (B, H, T); state (B, H, Dk, Dv), fp32.
    Inside a chunk with cumulative decay G, the updates u_t = beta_t (v_t - k_t^T S'_{t-1}) solve the unit
    lower-triangular system (I + A) U = beta (V - exp(G) K S0), A[t, i] = beta_t exp(G_t - G_i) k_t.k_i (i < t).
    Returns (out (B, H, T, Dv), final state)."""
    T = key.shape[2]
    outs = []
    for c0 in range(0, T, chunk):
        q, k, v = query[:, :, c0 : c0 + chunk], key[:, :, c0 : c0 + chunk], value[:, :, c0 : c0 + chunk]
        b = beta[:, :, c0 : c0 + chunk, None]  # (B, H, C, 1)
        G = log_decay[:, :, c0 : c0 + chunk].cumsum(-1)  # (B, H, C), non-increasing
        G_exp = G.exp()[..., None]  # (B, H, C, 1)
        # exp(G_t - G_i) for i <= t (<= 0 there); the clamp keeps the unused upper part finite
        # (exp of a large positive number), so no inf * 0 reaches the backward pass in training
        decay = (G[..., :, None] - G[..., None, :]).clamp(max=0.0).exp().tril()  # (B, H, C, C)
        # strictly lower part; solve_triangular(unitriangular=True) reads an implicit unit diagonal
        A = (b * decay * (k @ k.transpose(-1, -2))).tril(-1)
        rhs = b * (v - G_exp * (k @ state))  # (B, H, C, Dv)
        u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        outs.append(G_exp * (q @ state) + (decay * (q @ k.transpose(-1, -2))) @ u)
        G_last = G[..., -1:]  # (B, H, 1)
        last = (G_last - G).exp()[..., None]  # (B, H, C, 1): decay from each position to the chunk end
        state = G_last.exp()[..., None] * state + (k * last).transpose(-1, -2) @ u
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), state


def delta_rule_replay(state, key, value, log_decay, beta):
    """Final state after the given positions. state [N, ..., Dk, Dv]; key [N, ..., T, Hv, Dk] with T at dim -3."""
    for t in range(key.shape[-3]):
        state = delta_rule_step(state, key[..., t, :, :], value[..., t, :, :], log_decay[..., t, :], beta[..., t, :])
    return state


class RMSNormGated(nn.Module):
    """RMSNorm over the last dim with a plain (not zero-centred) weight, then times SiLU(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    # Single-token decode steps run the recurrence directly; every multi-token step (the
    # 16-token verify included) uses the chunked form, ~3x faster than 16 sequential steps.
    SEQUENTIAL_MAX_T = 1

    def __init__(self, args: TargetArgs):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = args.linear_key_dim
        self.value_dim = args.linear_value_dim
        self.conv_dim = args.linear_conv_dim
        self.kernel = args.linear_conv_kernel_dim
        H = args.hidden_size
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)

    def forward(self, x, conv_state, recurrent, num_new, valid, keep_inputs: bool, packing: RowPacking):
        """x [N, H] (the step's real rows, packed by ``packing``); conv_state [B, C, K-1]; recurrent
        [B, Hv, Dk, Dv] fp32; num_new [B] int64 (T_b, tokens per request); valid [B, T] bool or None
        (None: all T_b == T). Returns (out [N, H], conv_state after T_b, recurrent after T_b, replay
        inputs [B, T, ...] or None). The projections run on the N real rows; the conv and the delta
        rule on the padded [B, T] grid, where padded rows are zeros with g = beta = 0."""
        B, T = packing.batch, packing.width
        Hv, Dk, Dv = self.num_v_heads, self.head_k_dim, self.head_v_dim
        conv_in = packing.pad(self.in_proj_qkv(x))  # (B, T, C)
        z = self.in_proj_z(x).view(-1, Hv, Dv)  # (N, Hv, Dv)
        beta = packing.pad(self.in_proj_b(x).float().sigmoid())  # (B, T, Hv)
        log_decay = packing.pad(-self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float()))
        if valid is not None:  # padded rows are zeros already, unless they ran through the GEMMs too
            beta = beta * valid[..., None]
            log_decay = log_decay * valid[..., None]

        # causal depthwise conv over [committed tail | new tokens]
        window = torch.cat([conv_state.to(conv_in.dtype), conv_in.transpose(1, 2)], dim=2)  # (B, C, K-1+T)
        if gdn_backend.conv_backend(x.device) == "causal_conv1d":  # CUDA, when installed
            mixed = gdn_backend.causal_conv_silu(window, self.conv1d.weight[:, 0], T)  # (B, C, T)
        elif T == 1:  # decode: a dot product per channel
            mixed = F.silu((window * self.conv1d.weight[:, 0]).sum(-1, keepdim=True))  # (B, C, 1)
        elif T <= 64:  # verify-sized steps: K shifted multiply-adds beat oneDNN's small-conv setup (~0.15 ms)
            weight = self.conv1d.weight[:, 0]  # (C, K)
            acc = window[:, :, : T] * weight[:, :1]
            for j in range(1, self.kernel):
                acc = acc + window[:, :, j : j + T] * weight[:, j : j + 1]
            mixed = F.silu(acc)  # (B, C, T)
        else:
            mixed = F.silu(F.conv1d(window, self.conv1d.weight, groups=self.conv_dim))  # (B, C, T)
        if valid is None:
            new_conv = window[:, :, T:]
        else:  # request b's tail ends after its own T_b tokens
            idx = num_new[:, None] + torch.arange(self.kernel - 1, device=x.device)  # (B, K-1)
            new_conv = window.gather(2, idx[:, None, :].expand(B, self.conv_dim, -1))

        q, k, v = mixed.transpose(1, 2).float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = Hv // self.num_k_heads
        q = l2norm(q.reshape(B, T, -1, Dk)) * Dk**-0.5
        k = l2norm(k.reshape(B, T, -1, Dk))
        q_heads, k_heads = q, k  # (B, T, Hk, Dk), before repetition to the value heads
        if rep > 1:  # key head j serves value heads [j * rep, (j + 1) * rep)
            Hk = self.num_k_heads
            q = q[:, :, :, None].expand(B, T, Hk, rep, Dk).reshape(B, T, Hv, Dk)
            k = k[:, :, :, None].expand(B, T, Hk, rep, Dk).reshape(B, T, Hv, Dk)
        v = v.reshape(B, T, Hv, Dv)  # (B, T, Hv, Dv)

        if gdn_backend.delta_rule_backend(x.device) == "fla":  # CUDA, when flash-linear-attention imports
            core, state = gdn_backend.fla_delta_rule(q_heads, k_heads, v, log_decay, beta, recurrent)
            core = core.to(x.dtype)  # (B, T, Hv, Dv)
        elif T > self.SEQUENTIAL_MAX_T:
            core, state = delta_rule_chunked(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             log_decay.transpose(1, 2), beta.transpose(1, 2), recurrent)
            core = core.transpose(1, 2).to(x.dtype)  # (B, T, Hv, Dv)
        else:
            state = recurrent
            outs = []
            for t in range(T):
                state = delta_rule_step(state, k[:, t], v[:, t], log_decay[:, t], beta[:, t])
                outs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))  # (B, Hv, Dv)
            core = torch.stack(outs, dim=1).to(x.dtype)  # (B, T, Hv, Dv)
        out = self.out_proj(self.norm(packing.pack(core), z).reshape(-1, self.value_dim))  # (N, H)
        replay = (conv_in, k, v, log_decay, beta) if keep_inputs else None
        return out, new_conv, state, replay
