"""Triton when it is installed, else None: CPU-only installs (a plain ``pip install .``) have none,
and every kernel module keeps a torch path beside its Triton kernel."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised by tests/test_packaging.py in a subprocess
    triton = tl = None

# Each module dispatches CUDA tensors to its Triton kernel when this holds; chosen once, at import.
USE_TRITON = triton is not None and torch.cuda.is_available()
