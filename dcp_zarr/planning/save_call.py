"""The names writer.py calls while it is rewritten; the take-over itself is in ``dcp_internals.py``. To be removed
once the writer calls ``dcp_internals`` directly."""

from __future__ import annotations

from dcp_zarr.planning import dcp_internals
from dcp_zarr.planning.dcp_internals import SaveCall
from dcp_zarr.planning.save_planner import rank_plan

__all__ = ["SaveCall", "dcp_save_call", "give_back", "is_dcps_own", "take_over"]


def dcp_save_call() -> SaveCall | None:
    return dcp_internals.dcp_save_call()  # looked up when called: tests replace it there


def is_dcps_own(planner) -> bool:
    return dcp_internals.is_dcps_save_planner(planner)


def take_over(call: SaveCall) -> None:
    dcp_internals.take_over_save(call, rank_plan)


def give_back(planner) -> None:
    dcp_internals.give_back_save(planner)
