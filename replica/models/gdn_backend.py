"""Which kernels run the target's Gated DeltaNet layers: flash-linear-attention and causal-conv1d on CUDA.

- Delta rule: on CUDA, when `fla` (pip `fla-core`, pure-Python Triton kernels)
  imports, `chunk_gated_delta_rule` runs multi-token steps (prefill, the
  16-row verify) and `fused_recurrent_gated_delta_rule` single-token decode,
  both from the request's committed state, returning the state after the
  step's (padded) tokens. Padded positions carry g = 0 and beta = 0, so the
  final state is the state after each request's own tokens, as in the torch
  path. The accepted-prefix commit needs the state after k < T positions: the
  step keeps its per-position inputs (`ReplayInputs`) and `TargetModel.commit`
  replays k <= 16 recurrence steps (`delta_rule_replay`, a few tiny batched
  ops), the same on every backend, so no per-position state is stored.
- Depthwise causal conv: on CUDA, when `causal_conv1d` imports,
  `causal_conv1d_fn(window, weight, activation="silu")` over [committed tail |
  new tokens]; its last T outputs are the step's.
- Elsewhere (CPU, or the libraries missing) the torch code in
  `gated_deltanet.py` runs; it is the reference the CUDA paths are checked
  against (kernels/bench_gpu.py on a GPU, tests with stub modules here).
q and k reach fla l2-normalised and already scaled (scale=1.0), with their Hk
key heads: fla's grouped-value mapping (value head h reads key head
h // (Hv / Hk)) is the layer's own.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys

import torch


@functools.lru_cache(maxsize=None)
def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _import(module_name: str):
    """The module if it imports (a stub in sys.modules counts), else None."""
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    if not _installed(module_name.split(".")[0]):
        return None
    try:
        return importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - installed but unusable (built for another torch/CUDA): torch path
        return None


def fla_gated_delta_rule():
    """fla's `fla.ops.gated_delta_rule` module, or None."""
    module = _import("fla.ops.gated_delta_rule")
    if module is None or not hasattr(module, "chunk_gated_delta_rule"):
        return None
    return module


def causal_conv1d_fn():
    module = _import("causal_conv1d")
    return getattr(module, "causal_conv1d_fn", None) if module is not None else None


def delta_rule_backend(device: torch.device | str) -> str:
    """"fla" on CUDA when flash-linear-attention imports, else "torch"."""
    if torch.device(device).type == "cuda" and fla_gated_delta_rule() is not None:
        return "fla"
    return "torch"


def conv_backend(device: torch.device | str) -> str:
    """"causal_conv1d" on CUDA when the package imports, else "torch"."""
    if torch.device(device).type == "cuda" and causal_conv1d_fn() is not None:
        return "causal_conv1d"
    return "torch"


def fla_delta_rule(query, key, value, log_decay, beta, state):
    """query, key [B, T, Hk, Dk] (normalised, scaled); value [B, T, Hv, Dv]; log_decay, beta [B, T, Hv];
    state [B, Hv, Dk, Dv] fp32. Returns (out [B, T, Hv, Dv], state after the T positions, fp32)."""
    module = fla_gated_delta_rule()
    T = query.shape[1]
    fn = module.fused_recurrent_gated_delta_rule if T == 1 else module.chunk_gated_delta_rule
    out, final = fn(query, key, value, log_decay, beta, scale=1.0, initial_state=state, output_final_state=True)
    return out, final.float()


def causal_conv_silu(window: torch.Tensor, weight: torch.Tensor, num_new: int) -> torch.Tensor:
    """window [B, C, K-1+T]; weight [C, K] -> silu(conv) of the last T positions [B, C, T]."""
    out = causal_conv1d_fn()(window.contiguous(), weight, bias=None, activation="silu")
    return out[:, :, -num_new:]
