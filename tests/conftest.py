"""Suite-wide setup.

Triton reads TRITON_INTERPRET once, at its first import, so the CPU
interpreter must be chosen here, before any test module imports
``dspine.kernels``; on CUDA machines the compiled kernels run.

The tiny models of the suite are latency-bound: one intra-op thread is as
fast as two and does not fight other processes for the 2 CI cores.
"""

import os

import torch

# Programs that load an engine freeze the objects alive then (replica/gc_freeze.py); the suite runs
# many of their entry points in one process, whose cycles would all stay alive.
os.environ.setdefault("DSPINE_GC_FREEZE", "0")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)
