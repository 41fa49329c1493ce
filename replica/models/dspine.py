"""DSpine block drafter (Qwen3.8-27B-DSpine-b16 geometry by default), nanoGPT / gpt-fast style.

Notable features:
- Context fusion: the F target feature vectors of a committed position are
  concatenated ([F*H]), projected to H and RMS-normed; every draft layer turns
  that fused state into RoPE'd K/V at the position's absolute index and stores
  it in the draft KV pool (`append_context`), once per committed position.
- A block of BS = 16 rows: row 0 (the anchor, the last committed token) reads
  the target's embedding, rows 1..15 a learned placeholder embedding.
- N dense layers (RMSNorm, GQA attention, SwiGLU). Attention is causal inside
  the block and windowed over the context: a query at absolute position P sees
  keys at p with P - window < p <= P (`dspine.kernels.draft_attention`).
- The bridge after every layer (`dspine.kernels.bridge`): a per-row feature
  code read, a gated predecessor message, an RMS-scaled write; zero at anchors.
- Final RMSNorm and the TARGET's LM head (a shared reference: never copied,
  never quantized, never saved with the drafter).
- `draft` is batched over requests with different context lengths; each
  request's rows only ever see its own pool slots and its own block.
- `forward_train(features, tokens, anchor_pos)` is the differentiable twin
  of `append_context` + `draft` without the pool (distillation): A blocks
  per sequence share that sequence's context K/V, and the bridge runs as the
  plain-torch `bridge_ref` (tests/replica/models/test_dspine_train.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
import torch.nn as nn

from dspine.kernels import bridge as bridge_op
from dspine.kernels.bridge import bridge_ref
from dspine.kernels import draft_attention
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.swiglu import SwiGLU

__all__ = ["DraftArgs", "DraftOut", "DSpineDrafter", "RMSNorm", "RotaryTables", "apply_rope"]


@dataclass
class DraftOut:
    """One draft forward for NB blocks."""

    hidden: torch.Tensor  # [NB, BS, H] final-normed hidden (after the last bridge write)
    x_last: torch.Tensor  # [NB, BS, H] last layer's post-MLP residual BEFORE its bridge write
    rms: torch.Tensor  # [NB, BS] fp32: RMS of x_last (the last bridge's r_t)
    codes: torch.Tensor  # [NB, BS, D] fp32: the last bridge's codes (row 0: sqrt(D) codebook[anchor])
    logits: torch.Tensor | None = None  # [NB, BS, V] fp32, only with draft(..., compute_logits=True)

    @classmethod
    def make_dummy(cls, nb: int = 1, bs: int = 16, h: int = 8, d: int = 4) -> "DraftOut":
        return cls(torch.zeros(nb, bs, h), torch.zeros(nb, bs, h), torch.ones(nb, bs), torch.zeros(nb, bs, d))


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, in fp32 (fp64 for fp64 x), cast back to x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_acc(x.dtype))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(xf.dtype)).to(x.dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class RotaryTables:
    """cos / sin of the rotary angles for a set of positions, computed once and shared by every
    layer and by q and k (the angles are formed in float64 so that large positions stay exact)."""

    cos: torch.Tensor  # [..., T, 1, hd/2] (broadcast over heads)
    sin: torch.Tensor

    @classmethod
    def build(cls, pos: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype) -> "RotaryTables":
        """pos [..., T] absolute positions (int64); tables in ``dtype``."""
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float64) / head_dim))
        ang = (pos.to(torch.float64)[..., None] * inv_freq).to(dtype)  # [..., T, hd/2]
        return cls(ang.cos()[..., None, :], ang.sin()[..., None, :])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of x [..., T, heads, hd] (maths in the tables' dtype, result in x's)."""
        x1, x2 = x.to(self.cos.dtype).chunk(2, dim=-1)
        cos, sin = self.cos, self.sin
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE. x [..., T, heads, hd], pos [..., T] absolute positions (int64)."""
    return RotaryTables.build(pos, x.shape[-1], base, _acc(x.dtype)).apply(x)


class Attention(nn.Module):
    def __init__(self, a: DraftArgs):
        super().__init__()
        self.a = a
        self.q_proj = nn.Linear(a.hidden_size, a.q_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, a.kv_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, a.kv_dim, bias=False)
        self.o_proj = nn.Linear(a.q_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.norm_eps)

    def rotary(self, pos: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """Rotary tables for positions pos [..., T], for activations of ``dtype``."""
        return RotaryTables.build(pos, self.a.head_dim, self.a.rope_base, _acc(dtype))

    def kv(self, h: torch.Tensor, pos: torch.Tensor | RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., T, H], pos [..., T] (or its rotary tables) -> RoPE'd k, v [..., T, Hkv, hd]."""
        a = self.a
        rope = pos if isinstance(pos, RotaryTables) else self.rotary(pos, h.dtype)
        k = self.k_proj(h).unflatten(-1, (a.num_kv_heads, a.head_dim))
        v = self.v_proj(h).unflatten(-1, (a.num_kv_heads, a.head_dim))
        if a.qk_norm:
            k = self.k_norm(k)
        return rope.apply(k), v

    def forward(self, h, pos, pool_k, pool_v, ctx_slots, ctx_lens):
        """h [B, T, H]; pos [B, T] absolute positions or their RotaryTables (shared by all layers)."""
        a = self.a
        B, T, C = h.size()
        rope = pos if isinstance(pos, RotaryTables) else self.rotary(pos, h.dtype)
        q = self.q_proj(h).view(B, T, a.num_heads, a.head_dim)  # (B, T, Hq, hd)
        if a.qk_norm:
            q = self.q_norm(q)
        q = rope.apply(q)
        k, v = self.kv(h, rope)  # (B, T, Hkv, hd)
        dt = pool_k.dtype  # attention runs in the pool's dtype
        y = draft_attention(q.to(dt), k.to(dt), v.to(dt), pool_k, pool_v, ctx_slots, ctx_lens,
                            a.window, 1.0 / math.sqrt(a.head_dim))
        return self.o_proj(y.to(h.dtype).reshape(B, T, a.q_dim))

    def forward_train(self, h, pos, k_ctx, v_ctx, anchor_pos):
        """Differentiable twin of `forward` without the pool: the A blocks of a sequence share its context.
        h [B, A, BS, H]; pos [B, A, BS] absolute row positions (anchor_pos[..., None] + row); k_ctx, v_ctx
        [B, L, Hkv, hd] RoPE'd K/V of context positions 0..L-1. Block (b, i) sees context p < anchor_pos[b, i]
        and, like `draft_attention`, a query at P sees keys at p with P - window < p <= P."""
        a = self.a
        B, A, BS, _ = h.shape
        L, G = k_ctx.shape[1], a.num_heads // a.num_kv_heads
        q = self.q_proj(h).unflatten(-1, (a.num_heads, a.head_dim))
        if a.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q, pos, a.rope_base).unflatten(-2, (a.num_kv_heads, G))  # [B, A, BS, Hkv, G, hd]
        k, v = self.kv(h, pos)  # [B, A, BS, Hkv, hd]
        scale = 1.0 / math.sqrt(a.head_dim)
        s_ctx = torch.einsum("bitkgd,blkd->bikgtl", q, k_ctx) * scale  # [B, A, Hkv, G, BS, L]
        s_blk = torch.einsum("bitkgd,biskd->bikgts", q, k) * scale  # [B, A, Hkv, G, BS, BS]
        p_ctx = torch.arange(L, device=h.device)
        m_ctx = (p_ctx < anchor_pos[..., None, None]) & (p_ctx > pos[..., None] - a.window)  # [B, A, BS, L]
        r = torch.arange(BS, device=h.device)
        m_blk = (r[None, :] <= r[:, None]) & (r[:, None] - r[None, :] < a.window)  # [BS (query), BS (key)]
        s = torch.cat([s_ctx.masked_fill(~m_ctx[:, :, None, None], float("-inf")),
                       s_blk.masked_fill(~m_blk, float("-inf"))], dim=-1).softmax(-1)
        y = (torch.einsum("bikgtl,blkd->bitkgd", s[..., :L], v_ctx)
             + torch.einsum("bikgts,biskd->bitkgd", s[..., L:], v))
        return self.o_proj(y.reshape(B, A, BS, a.q_dim))


class Block(nn.Module):
    def __init__(self, a: DraftArgs):
        super().__init__()
        self.attn_norm = RMSNorm(a.hidden_size, a.norm_eps)
        self.attn = Attention(a)
        self.mlp_norm = RMSNorm(a.hidden_size, a.norm_eps)
        self.mlp = SwiGLU(a.hidden_size, a.intermediate_size)

    def forward(self, x, pos, pool_k, pool_v, ctx_slots, ctx_lens):
        x = x + self.attn(self.attn_norm(x), pos, pool_k, pool_v, ctx_slots, ctx_lens)
        return x + self.mlp(self.mlp_norm(x))  # post-MLP residual: the bridge reads this

    def forward_train(self, x, pos, k_ctx, v_ctx, anchor_pos):
        x = x + self.attn.forward_train(self.attn_norm(x), pos, k_ctx, v_ctx, anchor_pos)
        return x + self.mlp(self.mlp_norm(x))


class Bridge(nn.Module):
    """Bridge parameters (names are the contract the tail reads)."""

    def __init__(self, a: DraftArgs):
        super().__init__()
        D, M, H = a.code_dim, a.message_dim, a.hidden_size
        self.eps = a.bridge_eps
        self.codebook = nn.Parameter(torch.empty(a.vocab_size, D))  # [V, D] token codes (unit rows)
        self.gate_recv = nn.Parameter(torch.empty(M, D))  # G, shared across layers
        self.gate_pred = nn.Parameter(torch.empty(M, D))  # Gp
        self.value_proj = nn.Parameter(torch.empty(M, D))  # A
        self.gate_bias = nn.Parameter(torch.zeros(M))  # b
        self.read_proj = nn.ParameterList([nn.Parameter(torch.empty(D, H)) for _ in range(a.num_layers)])  # R_l
        self.write_proj = nn.ParameterList([nn.Parameter(torch.empty(H, M)) for _ in range(a.num_layers)])  # W_l

    def forward(self, layer: int, x: torch.Tensor, anchor_ids: torch.Tensor):
        return bridge_op(x, anchor_ids, self.codebook, self.read_proj[layer], self.gate_recv, self.gate_pred,
                         self.value_proj, self.gate_bias, self.write_proj[layer], self.eps)

    def forward_ref(self, layer: int, x: torch.Tensor, anchor_ids: torch.Tensor):
        """The plain-torch `bridge_ref` (differentiable, any device): training."""
        return bridge_ref(x, anchor_ids, self.codebook, self.read_proj[layer], self.gate_recv, self.gate_pred,
                          self.value_proj, self.gate_bias, self.write_proj[layer], self.eps)


class DSpineDrafter(nn.Module):
    def __init__(self, args: DraftArgs, embed_tokens: nn.Module | None = None,
                 lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        a = self.args = args
        self.fc = nn.Linear(a.fused_dim, a.hidden_size, bias=False)  # context fusion [F*H] -> [H]
        self.hidden_norm = RMSNorm(a.hidden_size, a.norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(a.hidden_size))  # placeholder input of rows 1..BS-1
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_layers))
        self.bridge = Bridge(a)
        self.norm = RMSNorm(a.hidden_size, a.norm_eps)
        self.set_shared(embed_tokens, lm_head_weight)

    # The target's embedding and LM head are held by reference, outside the module tree:
    # not in state_dict(), parameters() or .to(); never copied or quantized.
    def set_shared(self, embed_tokens, lm_head_weight) -> None:
        if lm_head_weight is not None and tuple(lm_head_weight.shape) != (self.args.vocab_size, self.args.hidden_size):
            raise ValueError(f"lm_head_weight shape {tuple(lm_head_weight.shape)} != "
                             f"(vocab_size, hidden_size) = {(self.args.vocab_size, self.args.hidden_size)}")
        self.__dict__["_shared"] = (embed_tokens, lm_head_weight)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.__dict__["_shared"][0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.__dict__["_shared"][1]

    # ------------------------------------------------------------------ context
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F, H] (target hidden states at the tap layers) -> fused context [..., H]."""
        w = self.fc.weight
        return self.hidden_norm(self.fc(features.flatten(-2).to(w.dtype)))

    @torch.no_grad()
    def append_context(self, pool, request_ids: Sequence[Hashable], features: Sequence[torch.Tensor]) -> None:
        """Fuse each request's new committed positions (features[b] [T_b, F, H]) and write their
        per-layer K/V into the pool at the next T_b absolute positions (all-or-nothing allocation)."""
        if len(request_ids) != len(features):
            raise ValueError(f"{len(request_ids)} request ids but {len(features)} feature tensors")
        counts = [int(f.shape[0]) for f in features]
        if sum(counts) == 0:
            return
        start = [pool.num_positions(r) for r in request_ids]
        slots = torch.cat(pool.append_many(request_ids, counts))  # [sum T]
        dev = pool.kv.device
        pos = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(start, counts)])
        ctx = self.fuse(torch.cat([f.to(dev) for f in features]))  # [sum T, H]
        rope = self.layers[0].attn.rotary(pos, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.attn.kv(ctx, rope)  # [sum T, Hkv, hd]
            pool.kv[i, 0, slots] = k.to(pool.dtype)
            pool.kv[i, 1, slots] = v.to(pool.dtype)

    # ------------------------------------------------------------------ block
    def block_inputs(self, anchor_ids: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        """[NB, BS, H]: row 0 the target's embedding of the anchor, rows 1.. the placeholder;
        ``num_rows`` (default the block size) rows."""
        NB, BS = anchor_ids.shape[0], self.args.block_size if num_rows is None else num_rows
        x = self.mask_embedding.expand(NB, BS, -1).clone()
        x[:, 0] = self.embed_tokens(anchor_ids).to(x.dtype)
        return x

    def forward_block(self, pool, request_ids: Sequence[Hashable], anchor_ids: torch.Tensor,
                      x: torch.Tensor) -> DraftOut:
        """Run the layers on given block inputs x [NB, BS, H] (`draft` builds x; tests perturb it)."""
        NB, BS, C = x.size()
        ctx_slots, ctx_lens = pool.context_slots(request_ids)  # [NB, Lmax], [NB]
        pos = pool.positions(request_ids)[:, None] + torch.arange(BS, device=x.device)  # [NB, BS] absolute
        rope = self.layers[0].attn.rotary(pos, x.dtype)
        out = None
        for i, layer in enumerate(self.layers):
            x_pre = layer(x, rope, pool.kv[i, 0], pool.kv[i, 1], ctx_slots, ctx_lens)
            out = self.bridge(i, x_pre, anchor_ids)
            x = out.x_out
        return DraftOut(hidden=self.norm(x), x_last=x_pre, rms=out.rms, codes=out.codes)

    @torch.no_grad()
    def draft(self, pool, request_ids: Sequence[Hashable], anchor_ids: torch.Tensor,
              compute_logits: bool = False, num_rows: int | None = None) -> DraftOut:
        """One draft block per request. anchor_ids [NB] int64: the last committed token of each request,
        which sits at position pool.num_positions(request) (its features are not in the pool yet).

        ``num_rows`` (2 .. block size; default the whole block) drafts only the block's first rows:
        attention inside the block is causal and every other op is per row, so they equal the
        whole block's first rows, and a step that verifies few rows does not pay for the rest."""
        if anchor_ids.shape != (len(request_ids),):
            raise ValueError(f"anchor_ids shape {tuple(anchor_ids.shape)} != ({len(request_ids)},)")
        if num_rows is not None and not 2 <= num_rows <= self.args.block_size:
            raise ValueError(f"num_rows: expected 2 .. {self.args.block_size}, got {num_rows}")
        anchor_ids = anchor_ids.to(self.mask_embedding.device)
        out = self.forward_block(pool, request_ids, anchor_ids, self.block_inputs(anchor_ids, num_rows))
        if compute_logits:
            out.logits = self.logits(out.hidden)
        return out

    def forward_train(self, features: torch.Tensor, tokens: torch.Tensor, anchor_pos: torch.Tensor) -> DraftOut:
        """Differentiable draft of A blocks per sequence, no KV pool (training; same maths as `draft`).

        features [B, L, F, H] target taps of positions 0..L-1; tokens [B, L]; anchor_pos [B, A] int64.
        Block (b, i) is what `draft` returns after `append_context(features[b, :a])` with anchor
        tokens[b, a], a = anchor_pos[b, i]. Returns DraftOut with hidden / x_last [B, A, BS, H],
        rms [B, A, BS], codes [B, A, BS, D] (logits not filled)."""
        a = self.args
        B, L = tokens.shape
        A, BS, H = anchor_pos.shape[1], a.block_size, a.hidden_size
        ctx = self.fuse(features)  # [B, L, H]
        ctx_pos = torch.arange(L, device=ctx.device).expand(B, L)
        anchor_ids = tokens.gather(1, anchor_pos)  # [B, A]
        x = torch.cat([self.embed_tokens(anchor_ids).to(ctx.dtype)[:, :, None],
                       self.mask_embedding.to(ctx.dtype).expand(B, A, BS - 1, H)], dim=2)  # [B, A, BS, H]
        pos = anchor_pos[..., None] + torch.arange(BS, device=ctx.device)  # [B, A, BS]
        flat_ids = anchor_ids.reshape(B * A)
        for i, layer in enumerate(self.layers):
            k_ctx, v_ctx = layer.attn.kv(ctx, ctx_pos)  # [B, L, Hkv, hd]
            x_pre = layer.forward_train(x, pos, k_ctx, v_ctx, anchor_pos)
            out = self.bridge.forward_ref(i, x_pre.reshape(B * A, BS, H), flat_ids)
            x = out.x_out.view(B, A, BS, H)
        return DraftOut(hidden=self.norm(x), x_last=x_pre, rms=out.rms.view(B, A, BS),
                        codes=out.codes.view(B, A, BS, -1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> fp32 logits [..., V] with the shared target LM head."""
        w = self.lm_head_weight
        return (hidden.to(w.dtype) @ w.t()).float()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Random init for tests and training: normal(std) matrices, unit norms, unit-norm codebook rows."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "bridge.gate_bias":
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
        cb = self.bridge.codebook
        cb.copy_(cb / cb.norm(dim=-1, keepdim=True).clamp_min(1e-12))
        self.mask_embedding.normal_(0.0, 1.0, generator=generator)
        for m in (self.bridge.gate_recv, self.bridge.gate_pred, self.bridge.value_proj):
            m.mul_(1.0 / (std * math.sqrt(self.args.code_dim)))  # unit-gain gates on sqrt(D)-norm codes
