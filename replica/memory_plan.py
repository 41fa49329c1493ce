"""The memory plan of one replica: what a target + drafter pair needs on one device, before serving.

Computed from the configs alone (nothing is allocated): ``dspine plan`` prints it and the
engine runs it at start, refusing a configuration that does not fit
(:class:`MemoryPlanError`). Every line is a logical payload (no allocator slack, no CUDA
context: ``PlanConfig.reserved_bytes`` is the place for those).

Lines (the 27B reference pair, BF16, 8 requests x 8,192 positions, in words):

- target weights: every parameter of the target (counted on a ``meta`` model, exact);
- drafter weights: its layers, fusion and bridge without the codebook
  (:func:`~dspine.replica.models.dspine_config.memory_report`, the report of ``dspine info``);
- target K/V: the full-attention layers only (16 of 64): 2 x 16 x 4 x 256 x 2 = 64 KiB per
  position, for ``max_concurrency x max_seq_len`` positions (or a configured pool);
- GDN states: per request the committed conv + recurrent state (recurrent in fp32) and the
  pending copy a step leaves beside it;
- GDN verify commit: what a ``verify_rows``-row verify keeps per request so that commit can take
  the state at the accepted prefix: the per-position recurrence inputs (``"inputs"``, today's torch
  path) or a recurrent state per position (``"states"``, kernels that emit them);
- draft pool: the draft KV pool's slots (dense: every position of every request; ring: the
  window), 20,480 B per slot at 27B;
- tail tables, codebook, retrieval copy of the head (FP8 on CUDA);
- kept draft features: the target features a speculative request keeps until it next drafts
  (its prompt's, its target-only steps'), at most 256 positions (or the window) per request:
  5 taps x 5,120 x 2 B x 256 = 12.5 MiB per request at 27B;
- activation peak: the largest of a verify step (``max_concurrency x verify_rows`` rows) and a
  prefill chunk (``prefill_chunk_tokens`` rows, logits for one row per request), each estimated as
  the largest live set of one layer plus the residual stream, the feature taps and the logits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .models.dspine_config import GiB, MiB, DraftArgs, memory_report
from .models.target_config import TargetArgs
from .runner_draft_context import MAX_DEFERRED_POSITIONS
from .types import RetrievalMode


class MemoryPlanError(ValueError):
    """The configuration does not fit in the device's memory (the engine refuses to start)."""

    def __init__(self, plan: "MemoryPlan"):
        super().__init__(
            f"memory plan: the configuration needs {_fmt(plan.total_bytes)} but the device has "
            f"{_fmt(plan.device_memory_bytes)} ({_fmt(-plan.left_bytes)} short); lower max_concurrency, "
            f"max_seq_len or use the ring draft pool\n{plan.format()}")
        self.plan = plan

    def __reduce__(self):
        return type(self), (self.plan,)


@dataclass(frozen=True)
class PlanConfig:
    """What the plan depends on beyond the two model configs (config as data)."""

    device_memory_bytes: int
    max_concurrency: int = 8
    max_seq_len: int = 8192
    draft_pool: str = "dense"  # "dense" | "ring"
    draft_pool_tokens: int | None = None  # slots; None: the engine's default (see draft_pool_slots)
    target_kv_tokens: int | None = None  # target K/V positions; None: max_concurrency x max_seq_len
    dtype_bytes: int = 2  # target weights, K/V, conv state, activations (BF16 on CUDA)
    draft_dtype_bytes: int = 2  # drafter, draft pool, tail tables
    retrieval: RetrievalMode | str = RetrievalMode.FP8  # the head copy the tail's scan reads
    verify_rows: int = 16  # rows of one verify per request (the drafter's block)
    verify_keeps: str = "inputs"  # "inputs" | "states": what a verify keeps for the prefix commit
    prefill_chunk_tokens: int = 4096
    attention_scores: bool = False  # the attention materialises its score matrix (CPU SDPA), not flash
    reserved_bytes: int = 0  # CUDA context, allocator slack, anything else kept off the plan
    num_drafters: int = 1  # 2: a sampled drafter of the same geometry too (its own weights and tail tables)

    def __post_init__(self):
        if self.device_memory_bytes <= 0:
            raise ValueError(f"device_memory: must be > 0 bytes, got {self.device_memory_bytes}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len: must be >= 2, got {self.max_seq_len}")
        if self.draft_pool not in ("dense", "ring"):
            raise ValueError(f"draft_pool: must be 'dense' or 'ring', got {self.draft_pool!r}")
        if self.num_drafters not in (1, 2):
            raise ValueError(f"num_drafters: must be 1 or 2, got {self.num_drafters}")
        if self.retrieval not in {m.value for m in RetrievalMode}:
            raise ValueError(f"retrieval: must be 'fp8', 'bf16' or 'exact', got {self.retrieval!r}")
        object.__setattr__(self, "retrieval", RetrievalMode(self.retrieval))
        if self.verify_keeps not in ("inputs", "states"):
            raise ValueError(f"verify_keeps: must be 'inputs' or 'states', got {self.verify_keeps!r}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens: must be >= 1, got {self.prefill_chunk_tokens}")


@dataclass(frozen=True)
class PlanLine:
    name: str
    bytes: int
    detail: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    lines: tuple[PlanLine, ...]
    device_memory_bytes: int
    description: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def left_bytes(self) -> int:
        return self.device_memory_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.left_bytes >= 0

    def line(self, name: str) -> PlanLine:
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(name)

    def format(self) -> str:
        width = max(len(line.name) for line in self.lines)
        rows = [self.description] if self.description else []
        rows += [f"  {line.name:<{width}}  {_fmt(line.bytes):>12}  {line.detail}".rstrip() for line in self.lines]
        rows.append(f"  {'total':<{width}}  {_fmt(self.total_bytes):>12}")
        rows.append(f"  {'device memory':<{width}}  {_fmt(self.device_memory_bytes):>12}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        rows.append(f"  {'left':<{width}}  {_fmt(self.left_bytes):>12}  {verdict}")
        return "\n".join(rows)


# ------------------------------------------------------------------ pieces shared with the engine
def draft_pool_slots(kind: str, max_concurrency: int, max_seq_len: int, window: int,
                     draft_pool_tokens: int | None = None) -> int:
    """Slots of the draft KV pool the engine builds: every admitted request at its largest (ring:
    its window) plus the padding sink (slot 0, never allocated), unless configured."""
    if draft_pool_tokens is not None:
        return draft_pool_tokens
    per_request = min(window, max_seq_len) if kind == "ring" else max_seq_len
    return max_concurrency * per_request + 1


def target_kv_bytes_per_position(args: TargetArgs, dtype_bytes: int) -> int:
    """K and V of every full-attention layer for one position (GDN layers keep no K/V)."""
    return 2 * len(args.full_layer_ids) * args.num_kv_heads * args.head_dim * dtype_bytes


def gdn_state_bytes(args: TargetArgs, dtype_bytes: int) -> int:
    """Committed conv state [Ll, C, K-1] (model dtype) + recurrent state [Ll, Hv, Dk, Dv] (fp32) of one request."""
    num_linear = len(args.linear_layer_ids)
    conv = num_linear * args.linear_conv_dim * (args.linear_conv_kernel_dim - 1) * dtype_bytes
    recurrent = num_linear * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    return conv + recurrent


def gdn_commit_bytes_per_position(args: TargetArgs, dtype_bytes: int, keeps: str) -> int:
    """What one verified position keeps for the accepted-prefix commit, all GDN layers."""
    num_linear, hv = len(args.linear_layer_ids), args.linear_num_value_heads
    if keeps == "states":  # a recurrent state and a conv tail per position
        return gdn_state_bytes(args, dtype_bytes)
    # ReplayInputs: conv_in [C] (dtype), key [Hv, Dk] + value [Hv, Dv] + log_decay, beta [Hv] (fp32)
    per_layer = (args.linear_conv_dim * dtype_bytes
                 + 4 * hv * (args.linear_key_head_dim + args.linear_value_head_dim + 2))
    return num_linear * per_layer


def activation_bytes(args: TargetArgs, rows: int, logit_rows: int, dtype_bytes: int, num_taps: int,
                     score_len: int = 0) -> int:
    """Estimated peak of one target forward over ``rows`` token rows (see the module docstring).

    residual stream, its norm and a layer's output [N, H]; feature taps [N, F, H]; the larger of
    the MLP ([N, I] gate, up and their product) and the token mixer (attention: q + gate, k, v,
    output; GDN: qkv, z and the fp32 q, k, v); the attention scores [Hq, N, S] fp32 when they are
    materialised; logits for ``logit_rows`` rows (model dtype, then fp32)."""
    n, h = rows, args.hidden_size
    stream = 3 * n * h * dtype_bytes
    taps = num_taps * n * h * dtype_bytes
    mlp = 3 * n * args.intermediate_size * dtype_bytes
    attention = n * (3 * args.num_heads + 2 * args.num_kv_heads) * args.head_dim * dtype_bytes if args.full_layer_ids else 0
    scores = args.num_heads * n * score_len * 4 if args.full_layer_ids else 0
    gdn = 0
    if args.linear_layer_ids:
        hv = args.linear_num_value_heads
        gdn = (n * (args.linear_conv_dim + args.linear_value_dim) * dtype_bytes
               + n * hv * (2 * args.linear_key_head_dim + args.linear_value_head_dim) * 4)
    logits = logit_rows * args.vocab_size * (dtype_bytes + 4)
    return stream + taps + max(mlp, attention + scores, gdn) + logits


def count_target_parameters(args: TargetArgs) -> int:
    """Parameters of the target built on the ``meta`` device (exact, nothing allocated)."""
    import torch

    from .models.target import TargetModel

    with torch.device("meta"):
        model = TargetModel(args)
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ the plan
def plan_memory(target: TargetArgs, drafter: DraftArgs | None, config: PlanConfig,
                target_weight_bytes: int | None = None) -> MemoryPlan:
    """The plan of ``target`` (+ ``drafter``) under ``config``. ``target_weight_bytes``: the bytes
    of an already loaded target (else counted from the config)."""
    c = config
    lines = []
    if target_weight_bytes is None:
        num_params = count_target_parameters(target)
        target_weight_bytes = num_params * c.dtype_bytes
        lines.append(PlanLine("target weights", target_weight_bytes, f"{num_params / 1e9:.3f} B parameters"))
    else:
        lines.append(PlanLine("target weights", target_weight_bytes, "as loaded"))
    report = memory_report(drafter, dtype_bytes=c.draft_dtype_bytes) if drafter is not None else None
    if report is not None:
        lines.append(PlanLine("drafter weights", report.layer_param_bytes + report.bridge_param_bytes
                              - report.codebook_bytes, "layers + fusion + bridge, codebook below; LM head shared"))

    kv_tokens = c.target_kv_tokens if c.target_kv_tokens is not None else c.max_concurrency * c.max_seq_len
    per_position = target_kv_bytes_per_position(target, c.dtype_bytes)
    lines.append(PlanLine("target K/V", kv_tokens * per_position,
                          f"{len(target.full_layer_ids)} full-attention layers, {per_position:,} B/position "
                          f"x {kv_tokens:,} positions"))
    if target.linear_layer_ids:
        state = gdn_state_bytes(target, c.dtype_bytes)
        lines.append(PlanLine("GDN states", 2 * state * c.max_concurrency,
                              f"{len(target.linear_layer_ids)} layers, conv + recurrent {_fmt(state)}/request, "
                              f"committed + pending, x {c.max_concurrency}"))
        keep = gdn_commit_bytes_per_position(target, c.dtype_bytes, c.verify_keeps)
        lines.append(PlanLine("GDN verify commit", keep * c.verify_rows * c.max_concurrency,
                              f"{c.verify_keeps} per position {_fmt(keep)} x {c.verify_rows} rows "
                              f"x {c.max_concurrency}"))

    if drafter is not None:
        slots = draft_pool_slots(c.draft_pool, c.max_concurrency, c.max_seq_len, drafter.window, c.draft_pool_tokens)
        lines.append(PlanLine("draft pool", slots * report.kv_bytes_per_position,
                              f"{c.draft_pool}, {report.kv_bytes_per_position:,} B/slot x {slots:,} slots"))
        gram = drafter.message_dim * drafter.message_dim * 4
        lines.append(PlanLine("tail tables", report.tail_table_bytes + gram,
                              f"[V, M] + [V, 2M] {_fmt(report.tail_table_bytes)} + [M, M] fp32 gram"))
        lines.append(PlanLine("codebook", report.codebook_bytes, "[V, D]"))
        retrieval = {RetrievalMode.FP8: drafter.vocab_size * (drafter.hidden_size + 4),
                     RetrievalMode.BF16: drafter.vocab_size * drafter.hidden_size * 2,
                     RetrievalMode.EXACT: 0}[c.retrieval]
        lines.append(PlanLine("retrieval head copy", retrieval, f"{c.retrieval.value} scan of [V, H]"))
        if c.num_drafters == 2:  # same geometry: the same sizes again; the pool and the head copy are shared
            second = sum(line.bytes for line in lines[-3:-1]) + (report.layer_param_bytes + report.bridge_param_bytes
                                                                 - report.codebook_bytes)
            lines.append(PlanLine("sampled drafter", second, "weights + tail tables + codebook of the second "
                                                             "drafter; draft pool and retrieval head copy shared"))

    if drafter is not None:
        # a speculative request's committed features wait for its next drafting step (the prompt's
        # and those of its target-only steps), up to a bound (runner_draft_context)
        kept = min(MAX_DEFERRED_POSITIONS, drafter.window)
        per_position = drafter.num_features * target.hidden_size * c.dtype_bytes
        lines.append(PlanLine("kept draft features", kept * per_position * c.max_concurrency,
                              f"{drafter.num_features} taps x {target.hidden_size:,} = {per_position:,} B/position "
                              f"x {kept} positions x {c.max_concurrency}"))

    num_taps = drafter.num_features if drafter is not None else 0
    verify_rows = c.max_concurrency * (c.verify_rows if drafter is not None else 1)
    score_len = c.max_seq_len if c.attention_scores else 0
    verify = activation_bytes(target, verify_rows, verify_rows, c.dtype_bytes, num_taps, score_len)
    chunk = min(c.prefill_chunk_tokens, c.max_seq_len)
    prefill = activation_bytes(target, chunk, min(c.max_concurrency, chunk), c.dtype_bytes, num_taps, score_len)
    peak, which = max((verify, f"{c.verify_rows}-row verify x {c.max_concurrency}"),
                      (prefill, f"prefill chunk of {chunk:,} tokens"))
    lines.append(PlanLine("activation peak", peak,
                          f"{which} (verify {_fmt(verify)}, prefill chunk {_fmt(prefill)}; estimate)"))
    if c.reserved_bytes:
        lines.append(PlanLine("reserved", c.reserved_bytes, "CUDA context, allocator slack"))
    pool = c.draft_pool if drafter is not None else "no drafter"
    description = (f"memory plan: {c.max_concurrency} requests x {c.max_seq_len:,} positions, {pool} draft pool, "
                   f"{_fmt(c.device_memory_bytes)} device")
    return MemoryPlan(tuple(lines), c.device_memory_bytes, description)


# ------------------------------------------------------------------ sizes
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of ``"141GB"`` (decimal), ``"139GiB"`` (binary) or a plain number of bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "").replace("_", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):] or "b"
    if unit not in _UNITS or not number:
        raise ValueError(f"device_memory: cannot read {text!r}; use e.g. 141GB, 139GiB or a byte count")
    return int(float(number) * _UNITS[unit])


def detect_device_memory(device) -> int:
    """Total memory of ``device``: the GPU's, or the host's physical memory for a CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fmt(n: int) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:,.2f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:,.1f} MiB"
    return f"{sign}{n:,} B"


def dtype_bytes(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


__all__ = ["PlanConfig", "PlanLine", "MemoryPlan", "MemoryPlanError", "plan_memory", "draft_pool_slots",
           "parse_size", "detect_device_memory", "target_kv_bytes_per_position", "gdn_state_bytes",
           "gdn_commit_bytes_per_position", "activation_bytes", "count_target_parameters"]


def plan_for_engine(target: TargetArgs, drafter: DraftArgs | None, config, max_seq_len: int,
                    target_weight_bytes: int | None = None, num_drafters: int = 1) -> MemoryPlan:
    """The plan the engine checks at start: ``config`` is its :class:`~dspine.replica.config.EngineConfig`
    (device memory configured, else detected: the GPU's, or the host's for a CPU)."""
    device = config.torch_device
    memory = config.device_memory if config.device_memory is not None else detect_device_memory(device)
    plan_config = PlanConfig(
        device_memory_bytes=memory, max_concurrency=config.max_concurrency, max_seq_len=max_seq_len,
        draft_pool=config.draft_pool, draft_pool_tokens=config.draft_pool_tokens,
        target_kv_tokens=config.target_kv_tokens, dtype_bytes=dtype_bytes(config.torch_dtype),
        draft_dtype_bytes=dtype_bytes(config.torch_draft_dtype), retrieval=config.retrieval_mode,
        verify_rows=drafter.block_size if drafter is not None else 1,
        prefill_chunk_tokens=config.prefill_chunk_tokens, attention_scores=device.type != "cuda",
        num_drafters=num_drafters if drafter is not None else 1)
    return plan_memory(target, drafter, plan_config, target_weight_bytes)
