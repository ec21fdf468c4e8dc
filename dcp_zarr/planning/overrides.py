"""The name writer.py and saving/item_writes.py call while the writer is rewritten; whether a planner's methods are
DCP's is decided in ``dcp_internals.py``. To be removed once they call ``dcp_internals`` directly."""

from __future__ import annotations

from dcp_zarr.planning.dcp_internals import keeps_dcps

__all__ = ["keeps_dcps"]
