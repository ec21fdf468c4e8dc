"""``ZarrSavePlanner``: a save planned on every rank from its own state dict, for ``ZarrWriter``.

DCP's planners hand the writer only WriteItems, and the writer sees the planner (and so the state dict: DTensor meshes
and placements) no sooner than ``write_data``, after DCP has gathered every rank's plan. This planner hands the writer,
in place of a plan, the rank's items together with its state dict (``RankState``), before the gather; the writer then
sends a digest instead (protocol.py), and DCP's gather, deduplication and scatter carry O(1) bytes per rank. Every
decision DCP's coordinator would make is made on each rank alike (placement/box_writers.py, placement/chunk_grids.py).
"""

from __future__ import annotations

from typing import NamedTuple

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from dcp_zarr.errors import InvalidEntryError
from dcp_zarr.gc_pause import step_with_collector_paused
from dcp_zarr.placement.boxes import dtensor_local_box, mesh_place, own_boxes_refused, says_its_own_boxes
from dcp_zarr.planning.dcp_internals import SAVE_PLANNER_STATE
from dcp_zarr.planning.protocol import Ticket
from dcp_zarr.torch_private import create_write_items


class RankState(NamedTuple):
    """What the writer needs of this rank before the gather: kept on the rank, never sent (the writer replaces the
    plan holding it with a ``Summary``; pickling it raises, so another writer cannot send it by mistake)."""

    items: list[WriteItem]
    state_dict: dict
    mappings: dict
    planner: DefaultSavePlanner  # a ZarrSavePlanner, or DCP's own planner taken over (dcp_internals.py)
    group: dist.ProcessGroup | None  # the one dcp.save runs on (None: the default group)

    def __reduce__(self):
        raise TypeError("ZarrSavePlanner plans saves for ZarrWriter only: pass storage_writer=ZarrWriter(...), or "
                        "use DCP's DefaultSavePlanner with other writers")


class ZarrSavePlanner(DefaultSavePlanner):
    """Plan a ``ZarrWriter`` save locally: ``dcp.save(sd, storage_writer=ZarrWriter(p), planner=ZarrSavePlanner())``.

    Each rank derives the store's layout and its own writes from its state dict; DCP's collectives carry a digest of
    each rank's structure and a small status. Ranks whose structures differ (a key on some ranks only, a pipeline
    stage's own layers) exchange what differs, once, before anything is written; entries that disagree under one key
    are refused with ``PlanMismatchError`` naming the keys and ranks.

    Args:
        process_group: the group ``dcp.save`` runs on (its ``process_group=``; default: the whole world). The
            writer checks that it is, and uses it when the ranks' structures differ and for collective I/O. A
            planner pickled into ``dcp.async_save``'s background process (``AsyncCheckpointerType.PROCESS``) plans
            there on that process's default group, the one DCP saves on there, whatever group it was given here.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(flatten_state_dict, flatten_sharded_tensors)
        self.process_group = process_group

    def __getstate__(self) -> dict:
        """What ``dcp.async_save(..., async_checkpointer_type=PROCESS)`` sends to its background process: the
        options, without the process group (a handle of this process, which pickle refuses) or a previous save's
        state dict and plan. There DCP saves on that process's default group, which ``process_group=None`` names."""
        state = dict(self.__dict__)
        state["process_group"] = None
        state["mappings"] = {}
        for per_save in SAVE_PLANNER_STATE:
            state.pop(per_save, None)
        return state

    def create_local_plan(self) -> SavePlan:
        self.plan = rank_plan(self, self.process_group)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # Nothing to deduplicate or validate here: the plans hold digests, which the writer compares. The metadata
        # DCP broadcasts to every rank at the end stays empty; the store's manifest is the checkpoint's metadata.
        self.metadata = Metadata(state_dict_metadata={})
        return all_plans, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not isinstance(new_plan.storage_data, Ticket):
            raise TypeError("ZarrSavePlanner plans saves for ZarrWriter only: the writer answered with "
                            f"{type(new_plan.storage_data).__name__}, not a ZarrWriter plan")
        self.plan = new_plan
        return new_plan


def rank_plan(planner: DefaultSavePlanner, group: dist.ProcessGroup | None) -> SavePlan:
    """This rank's plan for the writer, from the planner's state dict as set up for the save: no items for DCP to
    gather, and a ``RankState`` holding them (each box computed here) for the writer."""
    items = local_write_items(planner.state_dict)
    return SavePlan(items=[], planner_data=RankState(items, planner.state_dict, dict(planner.mappings), planner, group))


@step_with_collector_paused
def local_write_items(state_dict: dict) -> list[WriteItem]:
    """The items of DCP's ``create_default_local_save_plan``, each DTensor's box computed in arithmetic (boxes.py)
    instead of by torch's index tensors; anything else (ShardedTensors, plain tensors, values, tensor subclasses
    with their own ``__create_write_items__``, Partial placements) through DCP's own function
    (``torch_private.create_write_items``)."""
    items: list[WriteItem] = []
    meshes: dict[int, tuple] = {}  # boxes.mesh_place's
    for fqn, value in state_dict.items():
        if (type(value) is torch.Tensor or type(value) is torch.nn.Parameter) and says_its_own_boxes(value):
            raise InvalidEntryError(own_boxes_refused(fqn))
        if isinstance(value, DTensor):
            mesh_shape, coordinate = mesh_place(value.device_mesh, meshes)
            if coordinate is None:  # a DTensor on a mesh this rank is not in: DCP's rule, nothing to write
                continue
            item = _dtensor_item(fqn, value, mesh_shape, coordinate)
            if item is not None:
                items.append(item)
                continue
        items += create_write_items(fqn, value)
    return items


def _dtensor_item(fqn: str, tensor: DTensor, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]
                  ) -> WriteItem | None:
    """DCP's ``_create_write_items_for_dtensor``, or None where DCP would not call it or boxes.py cannot say."""
    local = tensor._local_tensor
    # (a plain tensor has no __create_write_items__: asked first, as hasattr's miss raises and catches inside)
    if (type(tensor).__create_write_items__ is not DTensor.__create_write_items__
            or (type(local) is not torch.Tensor and hasattr(local, "__create_write_items__"))):
        return None
    box = dtensor_local_box(tuple(tensor.shape), mesh_shape, tuple(tensor.placements), coordinate)
    if box is None:
        return None
    offsets, sizes = torch.Size(box[0]), torch.Size(box[1])
    # TensorProperties.create_from_tensor(tensor.to_local()), as DCP makes them, without to_local's autograd
    # Function: with grad enabled its output is a view of the local tensor (its strides, which torch 2.15's
    # properties hold, and pinning) that requires grad as the DTensor does; else it is the local tensor itself.
    properties = TensorProperties.create_from_tensor(local)
    properties.requires_grad = tensor.requires_grad if torch.is_grad_enabled() else local.requires_grad
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                 properties=properties, size=tensor.size()))
