"""Peak bytes of live tensors created inside a block: activation memory measured, not inferred.

torch's CPU allocator keeps no statistics (``torch.cuda.max_memory_allocated`` is CUDA-only) and
tracemalloc does not see torch's allocations, so :class:`PeakLiveTensors` counts them itself: a
``TorchDispatchMode`` that sees every op's outputs, adds the bytes of each new storage while a
tensor on it is alive (a weakref finalizer subtracts them) and keeps the high-water mark. Views
share their base's storage and are counted once. Tensors created before the block (weights,
states) are not counted; state a step keeps (K/V, GDN state) is, while it is alive.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakLiveTensors(TorchDispatchMode):
    """``with PeakLiveTensors() as probe: ...``; then ``probe.peak_bytes`` (and ``largest_bytes``)."""

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0  # the largest single storage created
        self._storages: dict[int, int] = {}  # storage data_ptr -> bytes, while a tensor on it lives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self._storages or nbytes == 0:
            return
        self._storages[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.largest_bytes = max(self.largest_bytes, nbytes)
        weakref.finalize(t, self._on_freed, key)

    def _on_freed(self, key: int) -> None:
        nbytes = self._storages.pop(key, 0)
        self.live_bytes -= nbytes
