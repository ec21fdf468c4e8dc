"""Planners that keep DCP's own planning for a save through ZarrWriter: ZarrWriter takes over DCP's own planner
(dcp_zarr/planning/dcp_internals.py), so a test of the path DCP plans passes one of these."""

from __future__ import annotations

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner


class DCPsPlanning(DefaultSavePlanner):
    """DCP's DefaultSavePlanner, but a subclass that overrides its global plan (with DCP's own): what a framework's
    planner that adds to DCP's planning looks like, and what ZarrWriter leaves DCP's protocol to."""

    def create_global_plan(self, all_plans):
        return super().create_global_plan(all_plans)
