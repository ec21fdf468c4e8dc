"""A load's read items made in arithmetic, for ``ZarrLoadPlanner`` and for DCP's own planner in a plain
``dcp.load(sd, storage_reader=ZarrReader(p))``.

ZarrReader presents every tensor as one saved chunk, the global array (reader.py, ``dcp_metadata``), so a rank's read
item for a tensor is its own box against that chunk. DCP's ``create_default_local_load_plan`` finds the box through
``compute_local_shape_and_global_offset`` (index computations in torch, per DTensor) and then sweeps it against the
saved chunks: a fifth of a load of 800 FSDP2 tensors, two fifths of one of 5,000 small ones
(benchmarks/reports/performance.md). Here the box comes from ``placement/boxes.py`` (the save's arithmetic), and the
item from the one overlap there is: the same ReadItems DCP makes, checked item for item on every rank of several
meshes (``tests/planning/test_load_plan.py``). Anything else (ShardedTensors, tensor subclasses, placements boxes.py
cannot say, another metadata's chunks, and every error DCP raises) goes through DCP's own function, entry by entry.

DCP's own planner is taken over for one call only (``dcp_internals.take_over_load``, from the reader's
``set_up_storage_reader``): its next ``create_local_plan`` plans with ``local_read_items``. A planner whose planning is
not DCP's (a subclass overriding ``set_up_planner`` or ``create_local_plan``) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from dcp_zarr.gc_pause import step_with_collector_paused
from dcp_zarr.placement.boxes import dtensor_local_box, mesh_place, says_its_own_boxes
from dcp_zarr.planning.dcp_internals import load_lookup_is_dcps
from dcp_zarr.torch_private import create_read_items

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NOT_HERE = object()  # a DTensor on a mesh this rank is not in: DCP's rule, nothing to read


@step_with_collector_paused
def local_read_items(state_dict: dict, metadata: Metadata, strict: bool = True) -> list[ReadItem]:
    """The items of DCP's ``create_default_local_load_plan(state_dict, metadata, strict)``, in the same order."""
    meshes: dict[int, tuple] = {}
    items: list[ReadItem] = []
    for fqn, value in state_dict.items():
        items += read_items_of(fqn, value, metadata, strict, meshes)
    return items


def read_items_of(fqn: str, value, metadata: Metadata, strict: bool, meshes: dict) -> list[ReadItem]:
    """DCP's read items for one entry of a state dict. ``meshes``: boxes.mesh_place's, the caller's across entries."""
    md = metadata.state_dict_metadata.get(fqn)
    if md is None and not strict:
        return []  # not in the checkpoint, and allowed to be missing: DCP's rule
    if isinstance(md, BytesStorageMetadata) and not isinstance(value, DTensor):
        return create_read_items(fqn, md, value)  # a value: one item, as DCP makes it
    box = _local_box(value, md, meshes) if isinstance(md, TensorStorageMetadata) and _is_whole(md) else None
    if box is _NOT_HERE:
        return []
    if box is None:  # DCP's own, for this entry: its items, or its error (looked up here: tests count its calls)
        return default_planner.create_default_local_load_plan({fqn: value}, metadata, strict).items
    assert isinstance(md, TensorStorageMetadata) and isinstance(box, tuple)
    item = _item_against_whole(fqn, md, *box)
    return [] if item is None else [item]


def _is_whole(md: TensorStorageMetadata) -> bool:
    """Whether the one saved chunk is the global array, as ZarrReader presents every tensor."""
    if len(md.chunks) != 1:
        return False
    chunk = md.chunks[0]
    return chunk.sizes == md.size and not any(chunk.offsets)


def _local_box(value, md: TensorStorageMetadata, meshes: dict):
    """This rank's (offsets, sizes) of ``value``, as DCP's ``_create_chunk_list`` gives them; ``_NOT_HERE``; or None
    where DCP's own function must say (another kind of value, a shape that does not match: DCP's error)."""
    if type(value) in _PLAIN:
        if value.shape != md.size or says_its_own_boxes(value):
            return None
        return (0,) * value.dim(), tuple(value.shape)
    if not isinstance(value, DTensor) or type(value).__create_chunk_list__ is not DTensor.__create_chunk_list__:
        return None
    local = value._local_tensor
    if type(local) is not torch.Tensor and hasattr(local, "__create_chunk_list__"):  # the local tensor's own
        return None
    if value.shape != md.size:
        return None
    mesh_shape, coordinate = mesh_place(value.device_mesh, meshes)
    if coordinate is None:
        return _NOT_HERE
    return dtensor_local_box(tuple(value.shape), mesh_shape, tuple(value.placements), coordinate)


def _item_against_whole(fqn: str, md: TensorStorageMetadata, offsets: tuple[int, ...], sizes: tuple[int, ...]
                        ) -> ReadItem | None:
    """DCP's ``create_read_items_for_chunk_list`` for one local chunk against one saved chunk at the origin: the
    overlap, or None where there is none (an empty piece)."""
    size = md.size
    lengths = []
    for offset, length, whole in zip(offsets, sizes, size):
        if offset >= whole or offset + length <= 0:
            return None
        lengths.append(min(whole, offset + length) - offset)
    return ReadItem(type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, torch.Size(offsets), 0),
                    dest_offsets=torch.Size((0,) * len(offsets)),
                    storage_index=MetadataIndex(fqn, md.chunks[0].offsets, 0),
                    storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths))


def destinations(planner) -> Callable[[ReadItem], torch.Tensor]:
    """``item -> planner.resolve_tensor(item).detach()``: the tensor a read item is read into. Where the planner's
    lookup is DCP's own, a DTensor's local tensor or a plain tensor is found without DCP's per-item lookups and
    ``to_local``'s autograd Function (a twentieth of a load of 800 tensors); narrowed as DCP's ``transform_tensor``
    would narrow it, which returns the tensor itself for a whole local shard."""
    if not load_lookup_is_dcps(planner):
        return lambda item: planner.resolve_tensor(item).detach()
    state_dict = planner.state_dict

    def destination(item: ReadItem) -> torch.Tensor:
        value = state_dict.get(item.dest_index.fqn)
        local: torch.Tensor
        if isinstance(value, torch.Tensor) and type(value) in _PLAIN and not any(item.dest_index.offset or ()) \
                and not says_its_own_boxes(value):
            local = value
        elif (isinstance(value, DTensor) and type(value).__get_tensor_shard__ is DTensor.__get_tensor_shard__
              and type(value._local_tensor) is torch.Tensor and not _is_partial(value)):
            local = value._local_tensor
        else:
            return planner.resolve_tensor(item).detach()
        if local.shape != item.lengths or any(item.dest_offsets):
            return planner.resolve_tensor(item).detach()  # a part of it: DCP narrows it
        return local.detach()

    return destination


def _is_partial(value: DTensor) -> bool:
    return any(placement.is_partial() for placement in value.placements)
