"""The target model: Qwen3.5-family hybrid (and plain Qwen3 dense) with explicit per-request state.

Notable features
- Qwen3.5 (`qwen3_5_text`): per `layer_types`, Gated DeltaNet layers
  (`gated_deltanet.py`) and gated full-attention layers: q_proj emits
  [query | gate] per head, output = o_proj(attn * sigmoid(gate)); q/k RMSNorm
  per head; partial RoPE (first `rotary_dim` of each head, rotate-half);
  zero-centred RMSNorm x_hat * (1 + w); SwiGLU MLP; tied or untied LM head.
- Qwen3 (`qwen3`): same skeleton, all full attention, plain RMSNorm, full
  RoPE, no output gate.
- Serving API (docs/contracts.md, "Target model"): `new_state()`,
  `forward_step(input_ids, states, feature_layers)` for a batch of requests
  with different committed lengths and different numbers of new tokens
  (padding is internal and never reaches a state), `commit(states, num_keep)`.
  New positions are pending until committed; see `target_state.py`.
- Full-attention K/V, two layouts (EngineConfig.target_kv_layout):
  paged (default): every request's K/V lives in blocks of the replica's
  preallocated `PagedKVPool`; a step writes only its new rows there. On CUDA
  attention reads the pool in place (flash-attn with a block table, else the
  project's Triton kernel: `kernels/paged_attention.py`); on CPU a torch path
  gathers each layer's keys transiently (counted by the pool) and runs SDPA
  with the same mask as the contiguous layout, so both give the same bits.
  contiguous (the original): one request -> attention reads its K/V buffer in
  place (no copy, no mask for T == 1); batches copy the committed K/V once per
  step into one padded buffer for all layers. Attention is torch SDPA with GQA.
- Feature taps: hidden state after layer i (before the final norm) for every
  new position, `[B, T, F, H]`.
- Layers: `target_layers.py` (RMSNorm), `swiglu.py` (the MLP), `target_attention.py`
  (gated full attention and the per-step context), `gated_deltanet.py`; this file is the
  decoder layer and the model: per-request state handling and the two K/V layouts' step set-up.
- Built on `meta` and loaded with `load_state_dict(assign=True)` by
  `loader.load_target`; parameter names equal the HF names without `model.`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspine import faults

from .gated_deltanet import GatedDeltaNet, delta_rule_replay
from .paged_kv_pool import PagedKVPool
from .row_packing import RowPacking
from .target_attention import Attention, PagedContext, StepContext
from .target_config import FULL, TARGET_CONFIGS, TargetArgs
from .swiglu import SwiGLU
from .target_layers import RMSNorm
from .target_state import ReplayInputs, StepOutput, TargetState

__all__ = ["TargetArgs", "TargetModel", "TargetState", "StepOutput", "TARGET_CONFIGS"]


class DecoderLayer(nn.Module):
    def __init__(self, args: TargetArgs, layer_id: int):
        super().__init__()
        self.is_full = args.layer_types[layer_id] == FULL
        self.kind_index = args.kind_index[layer_id]
        if self.is_full:
            self.self_attn = Attention(args)
        else:
            self.linear_attn = GatedDeltaNet(args)
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.zero_centred_norm)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.zero_centred_norm)


class TargetModel(nn.Module):
    def __init__(self, args: TargetArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.zero_centred_norm)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        # K/V bytes the contiguous layout copies per step (the padded batch buffer and the copy back
        # into each request's buffer); the paged layout never adds to it. Benches and tests read it.
        self.kv_copy_bytes = 0

    def _inv_freq(self, device=None) -> torch.Tensor:
        R = self.args.rotary_dim
        return 1.0 / (self.args.rope_theta ** (torch.arange(0, R, 2, dtype=torch.int64, device=device).float() / R))

    def reset_buffers(self, device=None) -> None:
        """Recompute non-persistent buffers (needed after building on `meta`)."""
        self.inv_freq = self._inv_freq(device=device or self.embed_tokens.weight.device)

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, H]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @classmethod
    def from_name(cls, name: str) -> "TargetModel":
        return cls(TargetArgs.from_name(name))

    # ------------------------------------------------------------------ state
    def new_kv_pool(self, num_blocks: int, block_size: int = 16, device=None, dtype=None) -> PagedKVPool:
        """A paged K/V pool shaped for this model's full-attention layers."""
        a = self.args
        return PagedKVPool(len(a.full_layer_ids), a.num_kv_heads, a.head_dim, num_blocks, block_size,
                           device=device or self.embed_tokens.weight.device,
                           dtype=dtype or self.embed_tokens.weight.dtype)

    def new_state(self, device=None, dtype=None, kv_pool: PagedKVPool | None = None, request_id=None) -> TargetState:
        """An empty state for one request (K/V and conv state in `dtype`, recurrent state in fp32).
        With `kv_pool` the full-attention K/V go to the request's blocks there (key `request_id`),
        else to per-request contiguous buffers."""
        a = self.args
        device = device or self.embed_tokens.weight.device
        dtype = dtype or self.embed_tokens.weight.dtype
        s = TargetState()
        if a.full_layer_ids and kv_pool is not None:
            if request_id is None:
                raise ValueError("new_state: a paged state needs a request_id")
            kv_pool.alloc_request(request_id)
            s.kv_pool, s.kv_id = kv_pool, request_id
        elif a.full_layer_ids:
            shape = (len(a.full_layer_ids), a.num_kv_heads, 0, a.head_dim)
            s.k_cache = torch.empty(shape, device=device, dtype=dtype)
            s.v_cache = torch.empty(shape, device=device, dtype=dtype)
        if a.linear_layer_ids:
            L = len(a.linear_layer_ids)
            s.conv_state = torch.zeros(L, a.linear_conv_dim, a.linear_conv_kernel_dim - 1, device=device, dtype=dtype)
            s.recurrent = torch.zeros(L, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim,
                                      device=device, dtype=torch.float32)
        return s

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def forward_step(self, input_ids, states: list[TargetState], feature_layers: tuple[int, ...] = (),
                     logits: str = "all") -> StepOutput:
        """Run new tokens for a batch of requests; they become pending in `states` (see `commit`).
        input_ids: Tensor [B, T] or list of 1-D Tensors [T_b]. `logits`: "all" rows [B, T, V],
        "last" (each request's last new position: [B, 1, V], what a prefill samples from) or
        "none" (a prefill chunk that samples nothing): the LM head over every prompt position
        would be [T, V] fp32, 8 GB for 8,192 tokens at the 27B vocabulary."""
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits: must be 'all', 'last' or 'none', got {logits!r}")
        return self._step(input_ids, states, feature_layers, logits=logits)

    def _step(self, input_ids, states: list[TargetState], feature_layers: tuple[int, ...],
              stateless: bool = False, logits: str = "all") -> StepOutput:
        a = self.args
        B = len(states)
        rows = list(input_ids) if isinstance(input_ids, (list, tuple)) else list(input_ids.unbind(0))
        if len(rows) != B:
            raise ValueError(f"got {len(rows)} input rows for {B} states")
        for b, s in enumerate(states):
            if s.num_pending:
                raise ValueError(f"state {b} still has {s.num_pending} pending positions; call commit() first")
        lens = [int(r.numel()) for r in rows]
        if min(lens, default=0) == 0:
            raise ValueError(f"every request needs at least one new token, got lengths {lens}")
        bad = [i for i in feature_layers if not 0 <= i < a.num_layers]
        if bad:
            raise ValueError(f"feature_layers {bad} outside [0, {a.num_layers})")
        device = self.embed_tokens.weight.device
        T = max(lens)
        ids = torch.zeros(B, T, dtype=torch.long, device=device)
        for b, r in enumerate(rows):
            ids[b, : lens[b]] = r.to(device)
        starts = [s.num_tokens for s in states]
        ar = torch.arange(T, device=device)
        positions = torch.tensor(starts, device=device)[:, None] + ar  # (B, T)
        num_new = torch.tensor(lens, device=device)
        valid = None if all(n == T for n in lens) else ar[None, :] < num_new[:, None]  # (B, T)

        packing = RowPacking(lens, valid)
        x = self.embed_tokens(packing.pack(ids))  # (N, H): only the real rows (row_packing.py)
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, R/2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, R)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        ctx = None
        if a.full_layer_ids and stateless:
            ctx = StepContext(cos, sin, None, None, starts, positions, T, None, uniform_start=True)
        elif a.full_layer_ids and states[0].kv_pool is not None:
            ctx = self._paged_context(states, starts, lens, positions, valid, T, cos, sin)
        elif a.full_layer_ids:
            if any(s.kv_pool is not None for s in states):
                raise ValueError("forward_step: paged and contiguous states cannot share a batch")
            key_len = max(starts) + T
            if B == 1:  # in place in the request's own buffers
                states[0].ensure_capacity(key_len)
                k_buf, v_buf = states[0].k_cache.unsqueeze(1), states[0].v_cache.unsqueeze(1)
            else:
                Lf = len(a.full_layer_ids)
                k_buf = x.new_zeros(Lf, B, a.num_kv_heads, key_len, a.head_dim)
                v_buf = x.new_zeros(Lf, B, a.num_kv_heads, key_len, a.head_dim)
                for b, s in enumerate(states):
                    k_buf[:, b, :, : starts[b]] = s.k_cache[:, :, : starts[b]]
                    v_buf[:, b, :, : starts[b]] = s.v_cache[:, :, : starts[b]]
                self.kv_copy_bytes += 2 * k_buf.numel() * k_buf.element_size()
            mask = None
            if B > 1 or T > 1:
                mask = (torch.arange(key_len, device=device)[None, None, :] <= positions[:, :, None])[:, None]
            ctx = StepContext(cos, sin, k_buf, v_buf, starts, positions, key_len, mask,
                               uniform_start=len(set(starts)) == 1)

        if a.linear_layer_ids:
            conv = states[0].conv_state[None] if B == 1 else torch.stack([s.conv_state for s in states])
            rec = states[0].recurrent[None] if B == 1 else torch.stack([s.recurrent for s in states])
            keep_inputs = 1 < T <= a.max_replay_tokens and not stateless  # T == 1: commit keeps 0 or all
            new_conv, new_rec, replay = [], [], []

        taps = {i: None for i in feature_layers}
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if layer.is_full:
                h = layer.self_attn(h, ctx, layer.kind_index, packing)
            else:
                j = layer.kind_index
                h, c, r, inp = layer.linear_attn(h, conv[:, j], rec[:, j], num_new, valid, keep_inputs, packing)
                new_conv.append(c)
                new_rec.append(r)
                replay.append(inp)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in taps:
                taps[i] = x
        if logits == "all":  # (B, T, V); padded rows are zeros
            logits = packing.pad(F.linear(self.norm(x), self.lm_head_weight).float())
        elif logits == "last":  # (B, 1, V)
            logits = F.linear(self.norm(packing.last_rows(x)), self.lm_head_weight).float()[:, None]
        else:
            logits = None
        features = packing.pad(torch.stack([taps[i] for i in feature_layers], dim=1)) if feature_layers else None

        if stateless:
            return StepOutput(logits=logits, features=features, num_new=lens)
        # ---- hand the pending positions to each request's state
        if a.full_layer_ids and B > 1 and ctx.paged is None:
            for b, s in enumerate(states):
                n, t = starts[b], lens[b]
                s.ensure_capacity(n + t)
                s.k_cache[:, :, n : n + t] = k_buf[:, b, :, n : n + t]
                s.v_cache[:, :, n : n + t] = v_buf[:, b, :, n : n + t]
                self.kv_copy_bytes += 2 * s.k_cache[:, :, n : n + t].numel() * k_buf.element_size()
        if a.linear_layer_ids:
            new_conv, new_rec = torch.stack(new_conv, dim=1), torch.stack(new_rec, dim=1)  # (B, Ll, ...)
            if keep_inputs:
                conv_in, key, value, g, beta = (torch.stack(t, dim=1) for t in zip(*replay))  # (B, Ll, T, ...)
        for b, s in enumerate(states):
            s.num_pending = lens[b]
            if a.linear_layer_ids:
                s.pending_conv, s.pending_recurrent = new_conv[b], new_rec[b]
                if keep_inputs:
                    t = lens[b]
                    s.replay = ReplayInputs(conv_in[b, :, :t], key[b, :, :t], value[b, :, :t], g[b, :, :t],
                                            beta[b, :, :t])
        return StepOutput(logits=logits, features=features, num_new=lens)

    # ------------------------------------------------------------------ commit
    @torch.no_grad()
    def commit(self, states: list[TargetState], num_keep: list[int]) -> None:
        """Keep the first num_keep[b] pending positions of each state; the rest leave no trace."""
        if len(num_keep) != len(states):
            raise ValueError(f"got {len(num_keep)} num_keep values for {len(states)} states")
        for b, (s, k) in enumerate(zip(states, num_keep)):
            if not 0 <= k <= s.num_pending:
                raise ValueError(f"num_keep[{b}] = {k} outside [0, {s.num_pending}] (pending positions)")
            if 0 < k < s.num_pending and s.recurrent is not None and s.replay is None:
                raise ValueError(
                    f"state {b}: a step of {s.num_pending} tokens (> max_replay_tokens "
                    f"{self.args.max_replay_tokens}) must be committed in full, got num_keep {k}")
        partial = []  # (state, k) whose GDN state needs a replay from the committed state
        for s, k in zip(states, num_keep):
            if s.recurrent is not None and k > 0:
                if k == s.num_pending:
                    s.conv_state, s.recurrent = s.pending_conv, s.pending_recurrent
                else:
                    tail = torch.cat([s.conv_state, s.replay.conv_in[:, :k].transpose(1, 2)], dim=2)  # (Ll, C, K-1+k)
                    s.conv_state = tail[:, :, k:]
                    partial.append((s, k))
        if partial:
            self._replay([s for s, _ in partial], [k for _, k in partial])
        for s, k in zip(states, num_keep):
            s.num_tokens += k
            s.clear_pending()
            if s.kv_pool is not None:  # rejected rows: only the length rewinds; whole blocks past it go back
                s.kv_pool.truncate(s.kv_id, s.num_tokens)

    def _paged_context(self, states, starts, lens, positions, valid, T, cos, sin) -> StepContext:
        """Reserve blocks for the new rows (all or nothing) and say where they go; no K/V is copied."""
        from dspine.kernels.paged_attention import paged_backend

        pool = states[0].kv_pool
        if any(s.kv_pool is not pool for s in states):
            raise ValueError("forward_step: every state of a batch must use the same K/V pool")
        B, device = len(states), positions.device
        ids = [s.kv_id for s in states]
        pool.reserve_many(ids, [n + t for n, t in zip(starts, lens)])
        key_len = max(starts) + T
        table = pool.block_table(ids, pool.blocks_needed(key_len))  # (B, W)
        new_slots = pool.slots(table, positions)  # (B, T)
        new_slots = new_slots.reshape(-1) if valid is None else new_slots[valid]
        if faults.active("paged_kv.slot_off_by_one"):
            new_slots = new_slots + 1
        backend = paged_backend(device, pool.block_size)
        read_slots = None
        if backend == "torch":
            read_slots = pool.slots(table, torch.arange(key_len, device=device).expand(B, key_len))
        mask = None
        if B > 1 or T > 1:  # the contiguous layout's mask, so the CPU path gives the same bits
            mask = (torch.arange(key_len, device=device)[None, None, :] <= positions[:, :, None])[:, None]
        ctx = StepContext(cos, sin, None, None, starts, positions, key_len, mask, uniform_start=len(set(starts)) == 1)
        starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
        ctx.paged = PagedContext(pool, new_slots, valid, table, starts_t, read_slots, backend)
        return ctx

    def _replay(self, states: list[TargetState], ks: list[int]) -> None:
        """Recurrent state after the first k pending positions, one batched replay (padded steps are no-ops)."""
        kmax = max(ks)

        def padded(name):  # (N, Ll, kmax, ...), zeros past each request's k (g = beta = 0: no-op)
            parts = [getattr(s.replay, name)[:, :k] for s, k in zip(states, ks)]
            out = parts[0].new_zeros(len(parts), parts[0].shape[0], kmax, *parts[0].shape[2:])
            for n, p in enumerate(parts):
                out[n, :, : p.shape[1]] = p
            return out

        rec = torch.stack([s.recurrent for s in states])  # (N, Ll, Hv, Dk, Dv)
        rec = delta_rule_replay(rec, padded("key"), padded("value"), padded("log_decay"), padded("beta"))
        for n, s in enumerate(states):
            s.recurrent = rec[n]

    # ------------------------------------------------------------------ stateless
    def forward(self, input_ids: torch.Tensor, feature_layers: tuple[int, ...] = ()) -> StepOutput:
        """Whole sequences from scratch, no state kept; differentiable (training). input_ids (B, T)."""
        states = [self.new_state() for _ in range(input_ids.shape[0])]
        return self._step(input_ids, states, feature_layers, stateless=True)
