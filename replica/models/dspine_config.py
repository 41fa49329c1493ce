"""Configuration of the DSpine drafter: `DraftArgs`, presets and the memory report.

- `DraftArgs`: one frozen dataclass, derived widths filled in `__post_init__`.
- `from_name()` registry: the released 27B preset `dspine-27b-b16` (every number
  from the article: block 16, taps 1/16/31/46/61, hidden 5,120, FFN 17,408,
  32 query / 8 KV heads of 128, 5 layers, window 8,192, RoPE base 1e7, code
  width 1,024, message width 512, head_topk 16, retrieval 128, vocab 248,320)
  and tiny presets for tests.
- `DraftArgs.for_target(target_args, **overrides)`: a tiny drafter whose vocab,
  hidden width and feature taps match a given target.
- `memory_report(args)`: resident bytes computed from the config alone (nothing
  is allocated): draft K/V per position, per window, for 131,072 positions,
  the token codebook and the greedy tail tables. `info_text(name)` formats it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class DraftArgs:
    block_size: int = 16  # BS: row 0 is the anchor, rows 1..BS-1 are proposals
    feature_layers: tuple[int, ...] = (1, 16, 31, 46, 61)  # target layers whose outputs feed the context
    hidden_size: int = 5120  # H (equals the target's hidden width: the LM head is shared)
    intermediate_size: int = 17_408  # SwiGLU FFN width
    num_heads: int = 32  # query heads
    num_kv_heads: int = 8
    head_dim: int = 128
    num_layers: int = 5
    window: int = 8192  # causal attention window over context + block
    rope_base: float = 10_000_000.0
    code_dim: int = 1024  # D: bridge feature-code width
    message_dim: int = 512  # M: bridge message width
    head_topk: int = 16  # K: tail candidates per proposal row
    num_retrieve: int = 128  # R: FP8 retrieval count before BF16 rescoring
    vocab_size: int = 248_320  # V (equals the target's vocabulary)
    norm_eps: float = 1e-6  # every learned RMSNorm
    bridge_eps: float = 1e-6  # the bridge's floors: x / (r + eps), z / (|z| + eps)
    qk_norm: bool = True  # per-head RMSNorm on q and k before RoPE (Qwen3-style draft layers)

    # derived (filled in __post_init__)
    num_features: int = field(init=False)  # F
    fused_dim: int = field(init=False)  # F * H, input width of the context fusion
    q_dim: int = field(init=False)  # num_heads * head_dim (27B: 4,096, not 5,120)
    kv_dim: int = field(init=False)  # num_kv_heads * head_dim
    num_proposals: int = field(init=False)  # BS - 1

    def __post_init__(self):
        taps = tuple(int(i) for i in self.feature_layers)
        if not taps:
            raise ValueError("feature_layers must name at least one target layer")
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size} must be >= 2 (an anchor and one proposal)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        if self.window < 1:
            raise ValueError(f"window {self.window} must be >= 1")
        if not 1 <= self.head_topk <= self.num_retrieve <= self.vocab_size:
            raise ValueError(
                f"need 1 <= head_topk ({self.head_topk}) <= num_retrieve ({self.num_retrieve}) "
                f"<= vocab_size ({self.vocab_size})"
            )
        setattr_ = object.__setattr__  # frozen dataclass
        setattr_(self, "feature_layers", taps)
        setattr_(self, "num_features", len(taps))
        setattr_(self, "fused_dim", len(taps) * self.hidden_size)
        setattr_(self, "q_dim", self.num_heads * self.head_dim)
        setattr_(self, "kv_dim", self.num_kv_heads * self.head_dim)
        setattr_(self, "num_proposals", self.block_size - 1)

    @classmethod
    def from_name(cls, name: str, **overrides) -> "DraftArgs":
        if name not in DRAFT_CONFIGS:
            raise ValueError(f"unknown drafter preset {name!r}; known: {sorted(DRAFT_CONFIGS)}")
        return cls(**{**DRAFT_CONFIGS[name], **overrides})

    @classmethod
    def for_target(cls, target_args, preset: str = "tiny", **overrides) -> "DraftArgs":
        """`preset` with vocab, hidden width and feature taps taken from `target_args`.

        Taps: the target's own `feature_layers` if it names any, otherwise up to
        five layers spread like the 27B choice (1 .. num_layers - 3).
        """
        taps = tuple(getattr(target_args, "feature_layers", ()) or ())
        if not taps:
            n = int(target_args.num_layers)
            f = min(5, n)
            taps = tuple(sorted({round(1 + i * (n - 4) / (f - 1)) for i in range(f)})) if n >= 5 else tuple(range(n))
        kw = dict(DRAFT_CONFIGS[preset], vocab_size=target_args.vocab_size,
                  hidden_size=target_args.hidden_size, feature_layers=taps)
        kw.update(overrides)
        if kw["num_retrieve"] > kw["vocab_size"]:
            kw["num_retrieve"] = kw["vocab_size"]
            kw["head_topk"] = min(kw["head_topk"], kw["vocab_size"])
        return cls(**kw)

    def to_config(self) -> dict:
        """config.json dict of a DSpine checkpoint: `model_type` plus every init field."""
        cfg = {"model_type": "dspine", "architectures": ["DSpineDrafter"]}
        for f in dataclasses.fields(self):
            if f.init:
                v = getattr(self, f.name)
                cfg[f.name] = list(v) if isinstance(v, tuple) else v
        return cfg

    @classmethod
    def from_config(cls, cfg: dict) -> "DraftArgs":
        if cfg.get("model_type") != "dspine":
            raise ValueError(f"config.json model_type {cfg.get('model_type')!r} is not 'dspine'")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(cfg) - names - {"model_type", "architectures"})
        if unknown:
            raise ValueError(f"config.json has unknown DSpine fields {unknown}")
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in names})


DRAFT_CONFIGS: dict[str, dict] = {
    # The released Qwen3.8-27B-DSpine-b16 drafter, as described in the article.
    "dspine-27b-b16": dict(
        block_size=16, feature_layers=(1, 16, 31, 46, 61), hidden_size=5120, intermediate_size=17_408,
        num_heads=32, num_kv_heads=8, head_dim=128, num_layers=5, window=8192, rope_base=10_000_000.0,
        code_dim=1024, message_dim=512, head_topk=16, num_retrieve=128, vocab_size=248_320,
    ),
    # Tiny drafter for tests and the embedded demo pair (matches the "tiny" target preset).
    "tiny": dict(
        block_size=16, feature_layers=(0, 1, 2), hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, num_layers=2, window=256, rope_base=10_000.0, code_dim=32,
        message_dim=16, head_topk=16, num_retrieve=32, vocab_size=512,
    ),
    # Even smaller block and window, for pool / window tests.
    "tiny-b4": dict(
        block_size=4, feature_layers=(0,), hidden_size=32, intermediate_size=64, num_heads=2,
        num_kv_heads=1, head_dim=16, num_layers=2, window=8, rope_base=10_000.0, code_dim=12,
        message_dim=8, head_topk=4, num_retrieve=8, vocab_size=64,
    ),
}


@dataclass(frozen=True)
class DraftMemoryReport:
    """Resident bytes of a drafter, from its config alone (logical payload, no allocator overhead)."""

    dtype_bytes: int  # bytes per element (2 for BF16)
    kv_bytes_per_position: int  # 2 (K, V) * layers * kv_heads * head_dim * dtype_bytes (27B: 20,480)
    kv_bytes_window: int  # one sequence holding `window` positions (27B: 160 MiB)
    long_context_positions: int  # 131,072 by default
    kv_bytes_long_context: int  # one sequence holding `long_context_positions` (27B: 2.5 GiB)
    codebook_bytes: int  # token codebook [V, D] (27B: 485 MiB)
    tail_table_bytes: int  # greedy tail tables [V, M] + [V, 2M] (27B: 727.5 MiB)
    layer_param_bytes: int  # fusion + dense layers + norms + placeholder (without the bridge)
    bridge_param_bytes: int  # R_l, W_l per layer + shared G, Gp, A, b + codebook
    shared_head_bytes: int  # the target's LM head [V, H]: shared, NOT an extra copy


def memory_report(args: DraftArgs, dtype_bytes: int = 2, long_context_positions: int = 131_072) -> DraftMemoryReport:
    a = args
    kv_pos = 2 * a.num_layers * a.num_kv_heads * a.head_dim * dtype_bytes
    H, L = a.hidden_size, a.num_layers
    per_layer = (
        H * a.q_dim + 2 * H * a.kv_dim + a.q_dim * H  # q, k, v, o projections
        + 3 * H * a.intermediate_size  # SwiGLU
        + 2 * H + (2 * a.head_dim if a.qk_norm else 0)  # norms
    )
    layers = a.fused_dim * H + H + L * per_layer + H + H  # fusion, its norm, layers, final norm, placeholder
    codebook = a.vocab_size * a.code_dim * dtype_bytes
    bridge = L * (a.code_dim * H + H * a.message_dim) + 3 * a.message_dim * a.code_dim + a.message_dim
    return DraftMemoryReport(
        dtype_bytes=dtype_bytes,
        kv_bytes_per_position=kv_pos,
        kv_bytes_window=kv_pos * a.window,
        long_context_positions=long_context_positions,
        kv_bytes_long_context=kv_pos * long_context_positions,
        codebook_bytes=codebook,
        tail_table_bytes=a.vocab_size * 3 * a.message_dim * dtype_bytes,
        layer_param_bytes=layers * dtype_bytes,
        bridge_param_bytes=bridge * dtype_bytes + codebook,
        shared_head_bytes=a.vocab_size * H * dtype_bytes,
    )


def _fmt(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:,.4g} GiB"
    if n >= MiB:
        return f"{n / MiB:,.5g} MiB"
    return f"{n:,} B"


def format_memory_report(r: DraftMemoryReport) -> str:
    w = r.kv_bytes_window // max(r.kv_bytes_per_position, 1)
    rows = [
        ("draft K/V per position", f"{r.kv_bytes_per_position:,} B"),
        (f"draft K/V, {w:,}-position window", _fmt(r.kv_bytes_window)),
        (f"draft K/V, {r.long_context_positions:,} positions", f"{_fmt(r.kv_bytes_long_context)} (dense pool)"),
        ("token codebook [V, D]", _fmt(r.codebook_bytes)),
        ("greedy tail tables [V, M] + [V, 2M]", _fmt(r.tail_table_bytes)),
        ("drafter layers + fusion", _fmt(r.layer_param_bytes)),
        ("bridge (incl. codebook)", _fmt(r.bridge_param_bytes)),
        ("target LM head", f"{_fmt(r.shared_head_bytes)} (shared, not copied)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def info_text(preset_name: str) -> str:
    """Text for `dspine info --draft-preset NAME`: the config and its memory report (BF16)."""
    args = DraftArgs.from_name(preset_name)
    head = [f"drafter preset {preset_name!r}"]
    for f in dataclasses.fields(args):
        head.append(f"  {f.name:<18} {getattr(args, f.name)}")
    return "\n".join(head) + "\nmemory (BF16, logical payload):\n" + format_memory_report(memory_report(args))
