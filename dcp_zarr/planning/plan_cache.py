"""DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``), as the writer must see through it.

From a caching planner's second save on, a rank whose local plan did not change sends ``SavePlan([], usable=False)``,
and the coordinator's planner hands the writer "deltas", empty unusable plans, instead of the global plan; each
rank's ``finish_plan`` then takes the final plan it cached at the last save, with that save's ``storage_data``
(staging location, save id). The plans themselves live in class attributes of ``SavePlanner``, keyed by the
planner's class name. The writer reads them there (this rank's last local plan; every rank's local plans and the
deduplicated global plan on the coordinator) and answers with complete, usable plans, so each save gets its own
staging location and its items, as DCP's FileSystemWriter gets them.
"""

from __future__ import annotations

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner


def uses_cache(plans: list[SavePlan]) -> bool:
    return any(not plan.usable for plan in plans)


def cached_local_plan() -> SavePlan:
    """This rank's local plan as the caching planner last sent it (what an unusable plan stands for)."""
    return _only("_cached_save_plan")


def cached_plans() -> tuple[list[SavePlan], list[SavePlan]]:
    """(every rank's local plan, the deduplicated global plan), on the coordinator of a caching planner's save."""
    return _only("_cached_all_plans"), _only("_cached_global_plan")


def _only(attribute: str):
    caches = getattr(SavePlanner, attribute, None) or {}
    if len(caches) != 1:
        found = ", ".join(sorted(caches)) or "none"
        raise RuntimeError(
            f"DCP's planner sent a cached (unusable) plan, and ZarrWriter cannot tell whose cache holds it: "
            f"SavePlanner.{attribute} has {len(caches)} entries ({found}). Use one caching planner class per "
            "process, or dcp_zarr.ZarrSavePlanner, which needs no cache")
    return next(iter(caches.values()))
