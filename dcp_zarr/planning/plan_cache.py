"""The names writer.py and saving/dcp_planned.py call while the writer is rewritten; DCP's plan caching, seen
through, is in ``dcp_internals.py``. To be removed once they call ``dcp_internals`` directly."""

from __future__ import annotations

from dcp_zarr.planning.dcp_internals import cached_local_plan, cached_plans
from dcp_zarr.planning.dcp_internals import uses_plan_cache as uses_cache

__all__ = ["cached_local_plan", "cached_plans", "uses_cache"]
