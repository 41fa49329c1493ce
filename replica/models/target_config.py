"""Configuration of the target model: `TargetArgs`.

- One frozen dataclass for both families the target supports: the Qwen3.5
  hybrid (HF `model_type` `qwen3_5_text`: Gated DeltaNet + gated full
  attention, zero-centred RMSNorm, partial RoPE) and plain Qwen3 dense
  (`qwen3`: all full attention, ordinary RMSNorm, full RoPE, no output gate).
- `from_hf_config(dict)` reads an HF `config.json` dict (also the multimodal
  wrapper, whose text part sits under `text_config`); `to_hf_config()` writes
  one back (used by `save_target`).
- `from_name()` registry: the 27B reference geometry and tiny presets.
- Derived fields (`__post_init__`): rotary width, per-kind layer index maps,
  GDN projection widths.
"""
from __future__ import annotations

from dataclasses import dataclass, field

FULL = "full_attention"
LINEAR = "linear_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3")


@dataclass(frozen=True)
class TargetArgs:
    model_type: str = "qwen3_5_text"  # "qwen3_5_text" (hybrid) or "qwen3" (dense)
    vocab_size: int = 248_320
    hidden_size: int = 5120
    intermediate_size: int = 17_408
    num_layers: int = 64
    num_heads: int = 24  # full-attention query heads
    num_kv_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25  # fraction of head_dim that is rotated
    layer_types: tuple[str, ...] = ()  # empty -> full attention every `full_attention_interval`-th layer
    full_attention_interval: int = 4
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    # Gated DeltaNet (linear attention) geometry
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    # Serving
    feature_layers: tuple[int, ...] = ()  # default taps for the drafter (27B: 1, 16, 31, 46, 61)
    max_replay_tokens: int = 64  # a step longer than this must be committed in full (see TargetState)
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None

    # derived (filled in __post_init__)
    rotary_dim: int = field(init=False)
    zero_centred_norm: bool = field(init=False)  # Qwen3.5 RMSNorm: x_hat * (1 + w)
    attn_output_gate: bool = field(init=False)  # Qwen3.5 q_proj emits [query | gate] per head
    full_layer_ids: tuple[int, ...] = field(init=False)  # layer ids with full attention
    linear_layer_ids: tuple[int, ...] = field(init=False)  # layer ids with Gated DeltaNet
    kind_index: tuple[int, ...] = field(init=False)  # layer id -> index among layers of its kind
    linear_key_dim: int = field(init=False)  # Hk * Dk
    linear_value_dim: int = field(init=False)  # Hv * Dv
    linear_conv_dim: int = field(init=False)  # 2 * key_dim + value_dim (conv channels)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
        hybrid = self.model_type == "qwen3_5_text"
        types = tuple(self.layer_types)
        if not types:
            if hybrid:
                k = self.full_attention_interval
                types = tuple(FULL if (i + 1) % k == 0 else LINEAR for i in range(self.num_layers))
            else:
                types = (FULL,) * self.num_layers
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries but num_layers is {self.num_layers}")
        bad = sorted(set(types) - {FULL, LINEAR})
        if bad or (not hybrid and LINEAR in types):
            raise ValueError(f"unsupported layer_types {bad or [LINEAR]} for model_type {self.model_type!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if LINEAR in types and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        bad_taps = [i for i in self.feature_layers if not 0 <= i < self.num_layers]
        if bad_taps:
            raise ValueError(f"feature_layers {bad_taps} outside [0, {self.num_layers})")
        rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if rotary_dim % 2 or rotary_dim <= 0:
            raise ValueError(f"rotary width {rotary_dim} (head_dim * partial_rotary_factor) must be even and > 0")
        full = tuple(i for i, t in enumerate(types) if t == FULL)
        linear = tuple(i for i, t in enumerate(types) if t == LINEAR)
        kind_index = tuple(full.index(i) if t == FULL else linear.index(i) for i, t in enumerate(types))
        key_dim = self.linear_key_head_dim * self.linear_num_key_heads
        value_dim = self.linear_value_head_dim * self.linear_num_value_heads
        setattr_ = object.__setattr__  # frozen dataclass
        setattr_(self, "layer_types", types)
        setattr_(self, "feature_layers", tuple(self.feature_layers))
        setattr_(self, "eos_token_id", tuple(self.eos_token_id))
        setattr_(self, "rotary_dim", rotary_dim)
        setattr_(self, "zero_centred_norm", hybrid)
        setattr_(self, "attn_output_gate", hybrid)
        setattr_(self, "full_layer_ids", full)
        setattr_(self, "linear_layer_ids", linear)
        setattr_(self, "kind_index", kind_index)
        setattr_(self, "linear_key_dim", key_dim)
        setattr_(self, "linear_value_dim", value_dim)
        setattr_(self, "linear_conv_dim", 2 * key_dim + value_dim)

    # ---------------------------------------------------------------- HF configs
    @classmethod
    def from_hf_config(cls, config: dict, **overrides) -> "TargetArgs":
        """Build from an HF config.json dict (`qwen3_5_text`, `qwen3`, or the `qwen3_5` wrapper)."""
        if "text_config" in config:  # multimodal wrapper (Qwen3_5ForConditionalGeneration)
            text = dict(config["text_config"])
            text.setdefault("model_type", "qwen3_5_text")
            if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
                text["tie_word_embeddings"] = config["tie_word_embeddings"]
            config = text
        model_type = config.get("model_type")
        if model_type == "qwen3_5":
            model_type = "qwen3_5_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported; set it to false in config.json")
        hybrid = model_type == "qwen3_5_text"
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is implemented")
        theta = rope.get("rope_theta", config.get("rope_theta", 10_000_000.0 if hybrid else 1_000_000.0))
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25 if hybrid else 1.0))
        num_heads = config["num_attention_heads"]
        eos = config.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        kw = dict(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            partial_rotary_factor=float(partial),
            layer_types=tuple(config.get("layer_types") or ()),
            full_attention_interval=config.get("full_attention_interval", 4),
            attention_bias=config.get("attention_bias", False),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            max_position_embeddings=config.get("max_position_embeddings", 32_768),
            eos_token_id=eos,
            bos_token_id=config.get("bos_token_id"),
        )
        if hybrid:
            for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                         "linear_num_key_heads", "linear_num_value_heads"):
                if name in config:
                    kw[name] = config[name]
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self) -> dict:
        """The HF config.json dict (`Qwen3_5ForCausalLM` / `Qwen3ForCausalLM`) describing these args."""
        hybrid = self.model_type == "qwen3_5_text"
        cfg = {
            "architectures": ["Qwen3_5ForCausalLM" if hybrid else "Qwen3ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "layer_types": list(self.layer_types),
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0])
            if self.eos_token_id else None,
        }
        if hybrid:
            cfg.update(
                linear_conv_kernel_dim=self.linear_conv_kernel_dim,
                linear_key_head_dim=self.linear_key_head_dim,
                linear_value_head_dim=self.linear_value_head_dim,
                linear_num_key_heads=self.linear_num_key_heads,
                linear_num_value_heads=self.linear_num_value_heads,
            )
        return cfg

    @classmethod
    def from_name(cls, name: str) -> "TargetArgs":
        if name not in TARGET_CONFIGS:
            raise ValueError(f"unknown target preset {name!r}; known: {sorted(TARGET_CONFIGS)}")
        return cls(**TARGET_CONFIGS[name])


TARGET_CONFIGS: dict[str, dict] = {
    # The reference target: 64 layers (GDN x3 + gated full attention, repeated), hidden 5,120,
    # vocab 248,320; attention / GDN geometry as in the Qwen3.5-27B config.
    "Qwen3.8-27B": dict(
        model_type="qwen3_5_text", vocab_size=248_320, hidden_size=5120, intermediate_size=17_408,
        num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256, rope_theta=10_000_000.0,
        partial_rotary_factor=0.25, full_attention_interval=4, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=48, tie_word_embeddings=False, max_position_embeddings=262_144,
        feature_layers=(1, 16, 31, 46, 61),
    ),
    # Tiny hybrid for tests and the embedded demo model (4 layers: GDN, GDN, GDN, full).
    "tiny": dict(
        model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0, partial_rotary_factor=0.5,
        full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        tie_word_embeddings=True, max_position_embeddings=4096, feature_layers=(0, 1, 2),
    ),
    # Tiny dense Qwen3.
    "tiny-qwen3": dict(
        model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0, partial_rotary_factor=1.0,
        tie_word_embeddings=True, max_position_embeddings=4096, feature_layers=(0,),
    ),
}
