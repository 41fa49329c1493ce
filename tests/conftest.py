"""Suite-wide setup. Triton reads TRITON_INTERPRET once, at its first import, so
the CPU interpreter must be chosen here, before any test module imports
``dspine.kernels``; on CUDA machines the compiled kernels run."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
