"""One rank's write items, written: each item's data found through the planner, its jobs built
(store_io/write_jobs.py) and run; one WriteResult per item."""

from __future__ import annotations

import io
from functools import partial

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from dcp_zarr.errors import InvalidEntryError
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.fill_values import fill_of, may_hold_in_fill
from dcp_zarr.format.sources import SourceDescriptions
from dcp_zarr.placement.boxes import own_boxes_refused, says_its_own_boxes
from dcp_zarr.planning.assignments import RankAssignment
from dcp_zarr.planning.dcp_internals import save_lookup_is_dcps
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.chunk_reuse import ChunkReuse, ReuseCounts
from dcp_zarr.store_io.write_jobs import NOT_LOOKED_UP, WriteJobs
from dcp_zarr.torch_private import sharded_tensor_type


def write_items(storage: Storage, items: list[WriteItem], assignment: RankAssignment, planner: SavePlanner,
                thread_count: int, with_sources: bool = True, reuse: ChunkReuse | None = None
                ) -> tuple[list[WriteResult], list[str], ReuseCounts]:
    """Write ``items`` and the zarr.json of the arrays this rank describes; (one WriteResult per item, the chunk
    keys written, the chunks stored: ``WriteJobs.stored``). A one-element array this rank describes is kept in its
    fill_value where it can be, with no chunk: its result's storage data says ``{"fill": value}``.
    ``with_sources``: each tensor's result says how it was held (a save DCP planned: its manifest is made from the
    results). ``reuse``: in a save that records its chunks, every chunk goes through it."""
    jobs = WriteJobs(storage, reuse)
    fills: dict[str, bool | int | float] = {}
    describe_source = SourceDescriptions(sharded_tensor_type())
    resolve = _tensor_resolver(planner)
    lookup = getattr(planner, "lookup_object", None)
    results: list[WriteResult] = []
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            value = NOT_LOOKED_UP if lookup is None else lookup(item.index)
            stored, size = jobs.value(fqn, assignment.nodes[fqn], value, partial(_saved_bytes, planner, item))
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=stored))
            continue
        assert item.tensor_data is not None  # DCP sets it on every item that is not BYTE_IO
        tensor = checked_tensor(resolve(item), fqn)
        spec = assignment.arrays[fqn]
        fill = held_in_fill(spec, tensor) if fqn in assignment.describes else None
        storage_data: dict = {}
        if fill is None:
            jobs.tensor(spec, tensor, item.tensor_data.chunk.offsets)
        else:
            fills[fqn] = storage_data["fill"] = fill
        if with_sources:
            storage_data["source"] = describe_source(getattr(planner, "state_dict", {}).get(fqn))
        results.append(WriteResult(index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                                   storage_data=storage_data))
    for fqn in sorted(assignment.describes):
        jobs.array_metadata(assignment.arrays[fqn], fills.get(fqn))
    jobs.run(thread_count)
    return results, jobs.chunk_keys, jobs.stored()


def held_in_fill(spec: ArraySpec, tensor: torch.Tensor) -> bool | int | float | None:
    """The fill_value that holds ``tensor``, the one element of an array this rank describes (format/fill_values.py),
    or None: its chunk is written. Only the rank writing the array's zarr.json may keep its element there."""
    if tensor.numel() != 1 or not may_hold_in_fill(spec.layout.shape, spec.data_type):
        return None
    return fill_of(tensor.reshape(()).item())


def checked_tensor(value, fqn: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidEntryError(
            f"state-dict entry {fqn!r}: expected a tensor, the planner returned {type(value).__name__}")
    tensor = value.detach()
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise InvalidEntryError(
            f"state-dict entry {fqn!r}: {tensor.layout} tensors are not supported; save a dense tensor")
    return tensor


def _saved_bytes(planner: SavePlanner, item: WriteItem) -> bytes:
    resolved = planner.resolve_data(item)
    assert isinstance(resolved, io.BytesIO)  # DCP's planners torch.save a BYTE_IO item into one
    return resolved.getvalue()


def _tensor_resolver(planner: SavePlanner):
    """``planner.resolve_data`` for tensor items; for DCP's own resolution (DefaultSavePlanner's, ZarrSavePlanner's)
    the state dict's tensor, or a DTensor's local one, looked up directly: DCP's lookup goes through its protocol
    checks and, for a DTensor, an autograd Function per tensor, which a save of 800 tensors felt."""
    state_dict = getattr(planner, "state_dict", None) if save_lookup_is_dcps(planner) else None
    if not isinstance(state_dict, dict):
        return planner.resolve_data

    def resolve(item: WriteItem):
        value = state_dict.get(item.index.fqn)
        if type(value) is DTensor:
            return value._local_tensor
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
            if says_its_own_boxes(value):  # a save DCP planned: its items are boxes this writer does not lay out
                raise InvalidEntryError(own_boxes_refused(item.index.fqn))
            return value
        return planner.resolve_data(item)  # anything else (ShardedTensor shards, subclasses) DCP's way

    return resolve
