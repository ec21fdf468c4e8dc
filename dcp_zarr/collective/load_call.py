"""The ranks of the ``dcp.load`` under way, so that its root ``zarr.json`` is read once, by its coordinator.

DCP calls ``read_metadata`` on every rank before anything else of a load, and tells the reader nothing of the call:
not its process group, nor whether every rank of it loads or one rank alone (``no_dist=True``). Read by every rank,
the root ``zarr.json`` (the manifest and a copy of every array's ``zarr.json``, about a kilobyte a tensor) is one
GET of one object per rank, and as many times its bytes: 8,192 GETs at 8,192 ranks, and at 4 ranks a fifth more
bytes than a load's tensors when the tensors are small (benchmarks/reports/storage-traffic.md).

A broadcast is only safe when every rank of the load makes it, and only DCP knows that: its ``_DistWrapper`` for the
call, which ``local_step`` of ``_load_state_dict`` holds as ``distW`` (torch 2.11 to 2.14). It is looked up in the
caller's frames; where it is not found (another torch, a call from outside ``dcp.load``), every rank reads the root
itself, as before, and nothing else changes. ``tests/test_read_once.py`` fails if torch stops keeping it there.
"""

from __future__ import annotations

import sys
from types import FrameType

_LOADER = "torch.distributed.checkpoint.state_dict_loader"


def dcp_load_wrapper(max_depth: int = 16):
    """DCP's ``_DistWrapper`` of the ``dcp.load`` calling us, or None."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "local_step" and frame.f_globals.get("__name__") == _LOADER:
            wrapper = frame.f_locals.get("distW")
            if wrapper is not None and hasattr(wrapper, "broadcast_object") and hasattr(wrapper, "use_dist"):
                return wrapper
            return None
        frame = frame.f_back
    return None
