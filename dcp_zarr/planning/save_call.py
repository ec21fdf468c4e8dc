"""DCP's own planner in the ``dcp.save`` under way, taken over so that ``dcp.save(sd, storage_writer=ZarrWriter(p))``
plans locally, as ``planner=ZarrSavePlanner()`` does.

DCP hands a writer its plan's WriteItems before the gather and its planner only in ``write_data``, after it: the
writer cannot tell from the items whether planning is DCP's own (a subclass may rewrite them in its global plan),
and a WriteItem says neither how a DTensor is split nor which ranks hold the same box, so every rank's box cannot
be derived from it. Both are in the ``dcp.save`` call: ``local_step`` of ``_save_state_dict`` (verified on torch
2.13.0, 2.14.1 and 2.15.0), which calls the writer's ``prepare_local_plan``, holds DCP's ``planner`` and its
``_DistWrapper`` ``distW`` (whose ``group`` is the process group the save runs on). They are looked up in the
caller's frames, as ``collective/load_call.py`` looks up a load's. Where they are not found (another torch), or the
planner is not DCP's own, the writer follows DCP's planning, as before: correct, and slower.
``tests/test_plain_save.py`` lists the releases verified and fails, saying which, if torch stops keeping them there.

A planner taken over plans no more for this save: its ``create_global_plan`` and ``finish_plan`` pass the writer's
own messages through (``protocol.py``), instance attributes removed again by the ``finish_plan`` every rank calls.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, NamedTuple

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from dcp_zarr.planning.overrides import keeps_dcps
from dcp_zarr.planning.protocol import Summary, Ticket
from dcp_zarr.planning.save_planner import RankState, local_write_items

_SAVER = "torch.distributed.checkpoint.state_dict_saver"
# DCP's methods a planner must not override to be taken over: what it plans and what it hands the writer. A
# subclass that overrides any of them (a planner that rewrites items, transforms tensors) keeps DCP's protocol.
_DCPS_OWN = ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan", "resolve_data",
             "lookup_object", "transform_object")
_TAKEN_OVER = ("create_local_plan", "create_global_plan", "finish_plan")


class SaveCall(NamedTuple):
    planner: DefaultSavePlanner
    group: Any  # the process group the save runs on; None: the default group, or no process group at all
    writer: Any  # the storage writer DCP was given


def _local_step(max_depth: int = 16) -> FrameType | None:
    frame: FrameType | None = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None or (frame.f_code.co_name == "local_step" and frame.f_globals.get("__name__") == _SAVER):
            return frame
        frame = frame.f_back
    return None


def dcp_save_call() -> SaveCall | None:
    """The planner, process group and writer of the ``dcp.save`` calling us, if its planner is DCP's own."""
    frame = _local_step()
    if frame is None:
        return None
    planner, wrapper = frame.f_locals.get("planner"), frame.f_locals.get("distW")
    if planner is not None:
        give_back(planner)  # a save that failed before its finish_plan left it taken over
    if wrapper is None or not hasattr(wrapper, "group") or not isinstance(planner, DefaultSavePlanner) \
            or not is_dcps_own(planner):
        return None
    return SaveCall(planner, wrapper.group, frame.f_locals.get("storage_writer"))


def is_dcps_own(planner) -> bool:
    """A ``DefaultSavePlanner`` (caching or not, deduplicating to the lowest rank or not) whose planning is DCP's."""
    return keeps_dcps(planner, DefaultSavePlanner, _DCPS_OWN)


def take_over(call: SaveCall) -> None:
    """For this save, the planner plans as ``ZarrSavePlanner`` does: each rank's plan is its items (made in
    arithmetic: DCP's own would make them again through torch's index computations) and state dict for the writer,
    the coordinator's global plan is the writer's messages as they are (nothing to deduplicate or cache: they are
    digests), and every rank's plan is the writer's answer, after which the planner is DCP's again. Should a save
    fail before that, the next save through this planner gives it back first: here if the writer is not the one
    that took it over, or where a message is not the writer's."""
    planner = call.planner

    def create_local_plan() -> SavePlan:
        frame = _local_step()
        if frame is None or frame.f_locals.get("storage_writer") is not call.writer:
            give_back(planner)
            return planner.create_local_plan()
        items = local_write_items(planner.state_dict)
        planner.plan = SavePlan(items=[], planner_data=RankState(items, planner.state_dict, dict(planner.mappings),
                                                                 planner, call.group))
        return planner.plan

    def create_global_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if not any(isinstance(plan.storage_data, Summary) for plan in all_plans):
            give_back(planner)  # not this save's messages: a save that failed left the planner taken over
            return planner.create_global_plan(all_plans)
        # Some ranks planned locally and some not: passed on as they are, for the writer to refuse by name.
        planner.metadata = Metadata(state_dict_metadata={})  # the store's manifest is the checkpoint's metadata
        planner.global_plan = all_plans
        return all_plans, planner.metadata

    def finish_plan(new_plan: SavePlan) -> SavePlan:
        give_back(planner)
        if not isinstance(new_plan.storage_data, Ticket):  # as above
            return planner.finish_plan(new_plan)
        planner.plan = new_plan
        return new_plan

    for method in (create_local_plan, create_global_plan, finish_plan):
        vars(method)["taken_over_by_dcp_zarr"] = True
        setattr(planner, method.__name__, method)
    vars(planner).pop("_pending_local_plan", None)  # a caching planner's: this save's plan is not DCP's to cache


def give_back(planner) -> None:
    """Remove what ``take_over`` set (only that: a planner's own instance attributes stay)."""
    for name in _TAKEN_OVER:
        if getattr(vars(planner).get(name), "taken_over_by_dcp_zarr", False):
            del vars(planner)[name]
