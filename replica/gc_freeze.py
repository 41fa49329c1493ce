"""Keep a loaded engine out of Python's full garbage collections.

After loading, a process holds some 300,000 objects the cyclic collector tracks (torch,
triton and the models' modules: functions, tuples, dicts), none of which will ever be
garbage. Every full collection walks them all: 95-113 ms on a 2-core CPU, a stall of one
decode step 40 times its length, at a moment set by how many objects the steps allocate
(speculative steps allocate more, so the stalls fell on them). :func:`freeze_after_load`
moves what is alive then into the collector's permanent generation, which full
collections skip; what the engine allocates afterwards is collected as before.

Called by the programs that load an engine to serve or bench it (the CLI, the standalone
server, the cluster's replica), not by :meth:`Engine.from_pretrained`: a library user or
a test suite that loads many engines in one process would keep every cycle alive at the
time of each freeze.
"""

from __future__ import annotations

import atexit
import gc
import os

from dspine import faults

__all__ = ["freeze_after_load"]

_unfreeze_registered = False


def freeze_after_load() -> int:
    """Collect the garbage of loading, then freeze every object alive (``gc.freeze``); returns how
    many objects the permanent generation now holds. Safe to call more than once. The environment
    variable ``DSPINE_GC_FREEZE=0`` turns it off (the test suite does: it runs many programs' entry
    points in one process)."""
    global _unfreeze_registered
    if os.environ.get("DSPINE_GC_FREEZE", "1") == "0" or faults.active("gc.not_frozen"):
        return gc.get_freeze_count()
    gc.collect()  # loading's garbage is freed, not kept for the process's life
    gc.freeze()
    if not _unfreeze_registered:
        # Frozen objects outlive interpreter shutdown's collection, and triton's bindings then
        # report their instances as leaked on stderr; handed back at exit, they are freed as usual.
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
    return gc.get_freeze_count()
