"""One rank's part of a locally planned save, gathered once from the planner's ``RankState``: its entries and its
items by key (placement/holdings.py), their dtypes and node paths checked, the digest of their structure, and the
rank's place in the process group DCP saves on. Everything after it (the summary, the replica checksums, the plan)
reads this value."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import WriteItem

from dcp_zarr.errors import PlanMismatchError
from dcp_zarr.format.torch_arrays import numpy_dtype
from dcp_zarr.placement.holdings import DTENSOR, Holding, group_rank_of, rank_entries, structure_digest
from dcp_zarr.planning.assignments import checked_node_paths
from dcp_zarr.planning.recent_plans import recent_plans
from dcp_zarr.planning.save_planner import RankState
from dcp_zarr.torch_private import sharded_tensor_type


@dataclasses.dataclass(frozen=True)
class NodesKey:
    """The node paths of a structure depend on nothing else."""

    digest: str


@dataclasses.dataclass(frozen=True, eq=False)
class RankPart:
    rank: int  # in DCP's process group
    world_size: int
    coordinator: bool
    group: Any  # the planner's process group, which is DCP's (protocol.check_summaries)
    planner: Any  # holds the state dict: a save is dropped with its part
    entries: dict[str, Holding]
    items: dict[str, list[WriteItem]]
    key_order: list[str]  # the state dict's own (DCP's planner_data), which numbers a flat optimizer's params
    digest: str  # holdings.structure_digest of the entries
    nodes: dict[str, str]  # fqn -> zarr node, checked for escapes and collisions

    def local_tensor(self, fqn: str) -> torch.Tensor | None:
        """This rank's data of a tensor entry (its first non-empty box), for a compression sample."""
        for item in self.items.get(fqn, ()):
            data = item.tensor_data
            if data is not None and all(data.chunk.sizes):
                value = self.planner.resolve_data(item)
                return value if isinstance(value, torch.Tensor) else None
        return None

    def box_nbytes(self) -> dict[str, int]:
        """fqn -> the bytes of this rank's (first) box of each entry."""
        return {fqn: item_nbytes(items[0]) for fqn, items in self.items.items()}


def gather_part(state: RankState, rank: int | None, coordinator: bool) -> RankPart:
    group = state.group
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size(group) if distributed else 1
    rank = rank if rank is not None else (dist.get_rank(group) if distributed else 0)
    group_rank = group_rank_of(group) if distributed else int
    entries, items = rank_entries(state.items, state.state_dict, state.mappings, rank, group_rank,
                                  sharded_tensor_type())
    for entry in entries.values():
        if entry.dtype is not None:
            numpy_dtype(entry.dtype)  # raises naming the dtype if unsupported
    digest = structure_digest(entries.values())
    nodes = recent_plans.made(NodesKey(digest),
                              lambda: checked_node_paths((fqn, e.path) for fqn, e in entries.items()))
    return RankPart(rank, world_size, coordinator, group, state.planner, entries, items,
                    list(state.mappings) or list(entries), digest, nodes)


def alone(part: RankPart) -> RankPart:
    """The part of a save DCP runs on this rank alone (``no_dist=True`` in a job with a process group, or a group of
    one): a world of one, unless an entry has parts on other ranks, which this save would leave out."""
    if part.world_size == 1:
        return part
    elsewhere = sorted(fqn for fqn, e in part.entries.items()
                       if (e.holding == DTENSOR and e.mesh is not None and len(e.mesh.root.ranks) > 1)
                       or any(r != part.rank for _, _, r in e.boxes))
    if elsewhere:
        listed = ", ".join(map(repr, elsewhere[:8])) + (f" and {len(elsewhere) - 8} more" if len(elsewhere) > 8
                                                         else "")
        raise PlanMismatchError(
            f"dcp.save runs on one rank, but {len(elsewhere)} entries have parts on other ranks ({listed}): "
            "they would be saved incomplete. Save them on every rank of their mesh, or save a full state dict")
    return dataclasses.replace(part, world_size=1, rank=0)


def item_nbytes(item: WriteItem) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
