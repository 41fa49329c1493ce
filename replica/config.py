"""Engine configuration: a frozen dataclass, built once from the cluster's pydantic config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .types import RetrievalMode

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 8  # requests in flight per engine; the released plugin allows at most 8
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    dtype: str = "auto"  # target dtype; "auto" -> bfloat16 on cuda, float32 on cpu
    # Drafter, draft KV pool and tail tables. Its precision never affects what is emitted
    # (verification is lossless whatever the proposal), only acceptance and speed.
    # "auto" -> the target's dtype (on a CPU with AVX512-BF16 a bf16 drafter measured no
    # faster than fp32 in a paired A/B on the embedded pair).
    draft_dtype: str = "auto"
    max_seq_len: int | None = None  # prompt + output; None -> the target's max_position_embeddings
    draft_pool: str = "dense"  # "dense" (as the released plugin) or "ring" (keeps only the window)
    draft_pool_tokens: int | None = None  # slots in the draft KV pool; None -> max_concurrency * max_seq_len
    # The tail's candidate retrieval: "fp8" (scan an FP8 head copy, rescore; CUDA), "bf16" (scan a
    # bf16 head copy; CPUs with native bf16 GEMMs), "exact" (the real head). "auto": fp8 on cuda,
    # bf16 on such CPUs, else exact. It changes only what is proposed, never what is emitted.
    retrieval: str = "auto"  # "auto" or a RetrievalMode value; resolved by ``retrieval_mode``
    speculative_default: bool = True  # used when a request does not say and a drafter is loaded
    prefill_chunk_tokens: int = 4096  # prompt tokens prefilled per forward
    # The target's full-attention K/V: "paged" (one preallocated PagedKVPool per replica, blocks
    # per request, steps write only their new rows; attention reads it in place on CUDA) or
    # "contiguous" (the original per-request buffers grown by doubling, batches copied into a
    # padded buffer every step). Same greedy output bit for bit on CPU.
    target_kv_layout: str = "paged"
    # Tokens per pool block. flash-attn 2's paged kernel needs a multiple of 256 (else CUDA runs
    # the project's Triton kernel, which takes any power of two >= 16).
    target_kv_block_size: int = 16
    # Blocks in the pool (block 0 is a padding sink); None -> every admitted request at its largest:
    # max_concurrency * ceil((max_seq_len + verify rows) / block) + 1.
    target_kv_blocks: int | None = None
    # Dynamic verification: verify draft row t only while the product of the drafter's
    # confidences of rows 1..t (each row's top candidate probability given the chosen previous
    # token, never its own draw) is >= this (0: always the whole block). Lossless either way.
    verify_threshold: float = 0.05
    # Adaptive speculation (replica/speculation_policy.py): each step, verify per request only the
    # draft rows whose expected tokens pay for their measured cost, or decode target-only when
    # drafting does not pay (probing again later). Off: every speculative request drafts every
    # step. Lossless either way.
    adaptive_speculation: bool = True
    # torch intra-op threads of the engine's device thread; None -> those of the thread that
    # builds the engine. A CPU replica sharing a machine with others sets it to its CPU share.
    num_threads: int | None = None
    # Memory (replica/memory_plan.py, replica/admission.py). The engine runs the memory plan at
    # start and refuses a configuration that does not fit (MemoryPlanError).
    device_memory: int | None = None  # bytes of the device; None -> detected (GPU total, or host RAM)
    memory_check: bool = True  # False: skip the start-up plan check (the plan is still computed)
    target_kv_tokens: int | None = None  # target K/V positions admission may hand out; None: unbounded
    # Tokens a request reserves in each pool at admission: "max_new_tokens" (prompt + max_new_tokens,
    # capped by max_seq_len: an admitted request never runs a pool out) or "prompt" (prompt + one
    # block; more requests fit, and a speculative request the draft pool cannot extend decodes on
    # target-only, losslessly).
    admission_reservation: str = "max_new_tokens"
    # A request that fits no pool now: "queue" (waits in the engine, first come first served) or
    # "refuse" (PoolExhaustedError -> RESOURCE_EXHAUSTED at once). One that can never fit is refused.
    admission_when_full: str = "queue"
    # Two drafters (replica/drafters.py): a request with temperature >= this drafts with the
    # sampled drafter (distilled on sampled continuations) when one is loaded, else with the
    # greedy one. Chosen once at admission; it changes only what is proposed, never what is emitted.
    sampled_draft_min_temperature: float = 0.3

    def __post_init__(self):
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.draft_pool not in ("dense", "ring"):
            raise ValueError(f"draft_pool: must be 'dense' or 'ring', got {self.draft_pool!r}")
        for name in ("dtype", "draft_dtype"):
            value = getattr(self, name)
            if value != "auto" and value not in _DTYPES:
                raise ValueError(f"{name}: must be 'auto' or one of {sorted(_DTYPES)}, got {value!r}")
        if self.retrieval != "auto" and self.retrieval not in {m.value for m in RetrievalMode}:
            raise ValueError(f"retrieval: must be 'auto', 'exact', 'fp8' or 'bf16', got {self.retrieval!r}")
        if not 0.0 <= self.verify_threshold < 1.0:
            raise ValueError(f"verify_threshold: must be in [0, 1), got {self.verify_threshold}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        if self.admission_reservation not in ("max_new_tokens", "prompt"):
            raise ValueError("admission_reservation: must be 'max_new_tokens' or 'prompt', "
                             f"got {self.admission_reservation!r}")
        if self.admission_when_full not in ("queue", "refuse"):
            raise ValueError(f"admission_when_full: must be 'queue' or 'refuse', got {self.admission_when_full!r}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens: must be >= 1, got {self.prefill_chunk_tokens}")
        for name in ("device_memory", "target_kv_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.target_kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"target_kv_layout: must be 'paged' or 'contiguous', got {self.target_kv_layout!r}")
        if self.target_kv_block_size < 1:
            raise ValueError(f"target_kv_block_size: must be >= 1, got {self.target_kv_block_size}")
        if self.target_kv_blocks is not None and self.target_kv_blocks < 2:
            raise ValueError(f"target_kv_blocks: must be >= 2 (block 0 is the padding sink), got {self.target_kv_blocks}")
        if not self.sampled_draft_min_temperature > 0.0:  # temperature 0 is greedy: it keeps the greedy drafter
            raise ValueError(f"sampled_draft_min_temperature: must be > 0, got {self.sampled_draft_min_temperature}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len: must be >= 2, got {self.max_seq_len}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def torch_draft_dtype(self) -> torch.dtype:
        if self.draft_dtype == "auto":
            return self.torch_dtype
        return _DTYPES[self.draft_dtype]

    @property
    def retrieval_mode(self) -> RetrievalMode:
        """The resolved retrieval ("auto" decided for this device)."""
        if self.retrieval != "auto":
            return RetrievalMode(self.retrieval)
        if self.torch_device.type == "cuda":
            return RetrievalMode.FP8
        cpu_bf16 = self.torch_device.type == "cpu" and _cpu_has_native_bf16()
        return RetrievalMode.BF16 if cpu_bf16 else RetrievalMode.EXACT


def _cpu_has_native_bf16() -> bool:
    """True when oneDNN runs bf16 GEMMs natively on this CPU (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
