"""Triton kernels, each beside its pure-torch ``*_ref`` reference (see STYLE.md)."""

from dspine.kernels.bridge import BridgeOut, bridge, bridge_ref, bridge_triton
from dspine.kernels.draft_attention import (
    draft_attention,
    draft_attention_ref,
    draft_attention_torch,
    draft_attention_triton,
)
from dspine.kernels.fp8_head_topk import (
    fp8_head_topk,
    fp8_head_topk_ref,
    fp8_head_topk_triton,
    head_topk_bf16,
    head_topk_exact,
    quantize_head_fp8,
    round_to_e4m3,
)
from dspine.kernels.paged_attention import (
    paged_attention,
    paged_attention_flash,
    paged_attention_ref,
    paged_attention_triton,
)
from dspine.kernels.tail_chain import tail_chain, tail_chain_ref, tail_chain_triton
from dspine.kernels.tail_tables import precompute_tail_tables, tail_tables, tail_tables_ref, tail_tables_triton

__all__ = [
    "BridgeOut",
    "bridge",
    "bridge_ref",
    "bridge_triton",
    "draft_attention",
    "draft_attention_ref",
    "draft_attention_torch",
    "draft_attention_triton",
    "fp8_head_topk",
    "fp8_head_topk_ref",
    "fp8_head_topk_triton",
    "head_topk_bf16",
    "head_topk_exact",
    "paged_attention",
    "paged_attention_flash",
    "paged_attention_ref",
    "paged_attention_triton",
    "quantize_head_fp8",
    "round_to_e4m3",
    "tail_chain",
    "tail_chain_ref",
    "tail_chain_triton",
    "tail_tables",
    "tail_tables_ref",
    "tail_tables_triton",
    "precompute_tail_tables",
]
