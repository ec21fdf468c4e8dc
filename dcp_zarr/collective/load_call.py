"""The ``dcp.load`` under way: its ranks, so that its root ``zarr.json`` is read once, by its coordinator, and its
planner, so that a load's read items are made in arithmetic (planning/load_plan.py).

DCP calls ``read_metadata`` on every rank before anything else of a load, and tells the reader nothing of the call:
not its process group, nor whether every rank of it loads or one rank alone (``no_dist=True``). Read by every rank,
the root ``zarr.json`` (the manifest and a copy of every array's ``zarr.json``, about a kilobyte a tensor) is one
GET of one object per rank, and as many times its bytes: 8,192 GETs at 8,192 ranks, and at 4 ranks a fifth more
bytes than a load's tensors when the tensors are small (benchmarks/reports/storage-traffic.md).

A broadcast is only safe when every rank of the load makes it, and only DCP knows that: its ``_DistWrapper`` for the
call, which ``local_step`` of ``_load_state_dict`` holds as ``distW`` (verified on torch 2.13.0, 2.14.1 and 2.15.0),
beside the ``planner`` whose ``create_local_plan`` it calls right after the reader's ``set_up_storage_reader``. Both
are looked up in the caller's frames; where they are not found (another torch, a call from outside ``dcp.load``),
every rank reads the root itself and DCP plans the load, as before, and nothing else changes.
``tests/test_read_once.py`` and ``tests/test_load_plan.py`` fail if torch stops keeping them there.
"""

from __future__ import annotations

import sys
from types import FrameType

_LOADER = "torch.distributed.checkpoint.state_dict_loader"


def _local_step(max_depth: int) -> FrameType | None:
    """The frame of DCP's ``local_step`` of the load calling the caller of our caller, or None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "local_step" and frame.f_globals.get("__name__") == _LOADER:
            return frame
        frame = frame.f_back
    return None


def dcp_load_wrapper(max_depth: int = 16):
    """DCP's ``_DistWrapper`` of the ``dcp.load`` calling us, or None."""
    frame = _local_step(max_depth)
    wrapper = None if frame is None else frame.f_locals.get("distW")
    if wrapper is not None and hasattr(wrapper, "broadcast_object") and hasattr(wrapper, "use_dist"):
        return wrapper
    return None


def dcp_load_planner(max_depth: int = 16):
    """The LoadPlanner of the ``dcp.load`` calling us (DCP's or the caller's), or None."""
    frame = _local_step(max_depth)
    return None if frame is None else frame.f_locals.get("planner")
