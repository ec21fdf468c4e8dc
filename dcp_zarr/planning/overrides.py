"""Whether a planner's methods are DCP's own: what lets dcp_zarr take its planning over, or find the tensors it
resolves without DCP's per-item lookups. A subclass or an instance attribute that overrides one keeps DCP's way."""

from __future__ import annotations

from collections.abc import Iterable


def keeps_dcps(planner, base: type, names: Iterable[str]) -> bool:
    """``planner`` is a ``base`` whose class and instance override none of the methods ``names``."""
    if not isinstance(planner, base):
        return False
    cls = type(planner)
    return all(getattr(cls, name) is getattr(base, name) and name not in vars(planner) for name in names)
