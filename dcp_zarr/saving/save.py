"""``Save``: what ``ZarrWriter`` asks of one save, whichever way it is planned.

Two kinds implement it: ``LocallyPlannedSave`` (each rank plans its part; DCP carries digests) and ``DcpPlannedSave``
(a planner that plans for itself; DCP's global plan is turned into nodes and layouts). The writer hands each of DCP's
callbacks to the save under way and never asks which kind it has. Both begin and end in ``coordinator.py``.
"""

from __future__ import annotations

from typing import Protocol

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from dcp_zarr.saving.settings import SaveSettings
from dcp_zarr.store_io.chunk_reuse import ReuseCounts


class Save(Protocol):
    settings: SaveSettings
    is_coordinator: bool
    written_keys: list[str]  # this rank's chunk keys, once ``write`` ran
    reuse_counts: ReuseCounts | None  # in a save that records its chunks, this rank's linked and written, once ran

    def local_plan(self, plan: SavePlan) -> SavePlan:
        """What DCP gathers from this rank (every rank)."""
        ...

    def global_plans(self, plans: list[SavePlan]) -> list[SavePlan]:
        """What DCP scatters to every rank (the coordinator): the save begun, nothing written yet."""
        ...

    def write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """This rank's part written (every rank)."""
        ...

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The manifest and the commit (the coordinator), through ``coordinator.py``."""
        ...
