"""Each array's chunk layout, derived from how it is held: the layout DCP's deduplicated boxes would give.

``format/layout.chunk_layout_for_boxes`` takes every saved box; a rank planning alone has only its own. For a DTensor
the boxes follow from the global shape, the mesh shape and the placements, so ``dtensor_layout`` computes the same
grid from those: in closed form when each dim is split by at most one ``Shard`` (FSDP, HSDP, most TP), in O(1) of
the world size; else (a dim split twice, ``_StridedShard``) from the boxes of every mesh coordinate, enumerated
once per kind of array (the arrays of a model have few shapes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from dcp_zarr.format.layout import ChunkLayout, array_shard_layout, chunk_layout_for_boxes, inner_rows_for_chunk
from dcp_zarr.local_plan.entries import BOX, DTENSOR, EVERY_RANK, SHARDS, Entry

Box = tuple[tuple[int, ...], tuple[int, ...]]


def entry_layout(entry: Entry, itemsize: int, inner_chunk_bytes: int, array_shards: bool,
                 boxes: Sequence[Box] | None = None) -> tuple[ChunkLayout, int]:
    """(the array's layout, how many non-empty boxes are saved). ``boxes``: every distinct box, where only an
    exchange knows them (exchange.py); else they follow from the entry."""
    if boxes is None:
        if entry.holding == DTENSOR:
            assert entry.mesh is not None  # every DTENSOR entry has one
            return dtensor_layout(entry.size, entry.mesh.shape, entry.placements, itemsize, inner_chunk_bytes,
                                  array_shards)
        if entry.holding == EVERY_RANK:
            return _whole_layout(entry.size, itemsize, inner_chunk_bytes)
        else:
            assert entry.holding in (SHARDS, BOX)
            boxes = sorted({(offsets, sizes) for offsets, sizes, _ in entry.boxes})
    return _layout_of_boxes(entry.size, boxes, itemsize, inner_chunk_bytes, array_shards)


@lru_cache(maxsize=4096)
def _whole_layout(size: tuple[int, ...], itemsize: int, inner_chunk_bytes: int) -> tuple[ChunkLayout, int]:
    """The layout of an array one rank writes whole (cached: a model's plain tensors have few shapes)."""
    return _layout_of_boxes(size, [((0,) * len(size), size)], itemsize, inner_chunk_bytes, False)


def _layout_of_boxes(size: tuple[int, ...], boxes: Sequence[Box], itemsize: int, inner_chunk_bytes: int,
                     array_shards: bool) -> tuple[ChunkLayout, int]:
    layout = chunk_layout_for_boxes(size, boxes, itemsize, inner_chunk_bytes)
    if array_shards:
        layout = array_shard_layout(layout, boxes) or layout
    return layout, sum(1 for _, sizes in boxes if all(sizes))


@lru_cache(maxsize=4096)
def dtensor_layout(size: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, itemsize: int,
                   inner_chunk_bytes: int, array_shards: bool) -> tuple[ChunkLayout, int]:
    """The layout of a DTensor's array and its count of non-empty boxes (cached: a model has few kinds of array)."""
    pieces = _pieces_per_dim(len(size), mesh_shape, placements)
    if pieces is None:
        return _layout_of_boxes(size, dtensor_boxes(size, mesh_shape, placements), itemsize, inner_chunk_bytes,
                                array_shards)
    if 0 in size:  # every box is empty: nothing constrains the grid (chunk_layout_for_boxes' rule)
        chunk = tuple(max(n, 1) for n in size)
        return ChunkLayout(size, chunk, inner_rows_for_chunk(chunk, itemsize, inner_chunk_bytes)), 0
    chunk_shape, blocks = [], []
    for n, k in zip(size, pieces):
        c = -(-n // k)  # torch.chunk's split: blocks of ceil(n/k), the last shorter, trailing ones empty
        count = -(-n // c)
        blocks.append(count)
        chunk_shape.append(c if count > 1 else n)  # the gcd of the inner boundaries, multiples of c
    chunk = tuple(chunk_shape)
    layout = ChunkLayout(size, chunk, inner_rows_for_chunk(chunk, itemsize, inner_chunk_bytes))
    # array_shard_layout's conditions: at least two non-empty boxes, split along dim 0 only
    if array_shards and size and blocks[0] > 1 and all(b == 1 for b in blocks[1:]):
        rows = layout.inner_rows or layout.chunk_shape[0]
        layout = ChunkLayout(size, (-(-size[0] // rows) * rows, *size[1:]), rows, layout.separator)
    return layout, math.prod(blocks)


def _pieces_per_dim(ndim: int, mesh_shape: tuple[int, ...], placements: tuple) -> list[int] | None:
    """How many torch.chunk pieces each tensor dim is cut into, when each is cut by at most one plain Shard;
    None otherwise (the boxes are then enumerated)."""
    pieces = [1] * ndim
    for n, placement in zip(mesh_shape, placements):
        if type(placement) is Shard:
            if pieces[placement.dim] != 1 and n > 1:
                return None
            pieces[placement.dim] *= n
        elif not (isinstance(placement, Replicate) or placement.is_partial()):
            return None
    return pieces


def dtensor_boxes(size: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> list[Box]:
    """Every distinct box of a DTensor, as DTensor computes each rank's (mesh dims that do not shard stay at 0)."""
    ranges = [range(n) if shards_along(placement) else range(1) for n, placement in zip(mesh_shape, placements)]
    boxes = set()
    for coordinate in itertools.product(*ranges):
        sizes, offsets = _compute_local_shape_and_global_offset(size, mesh_shape, list(coordinate), placements)
        boxes.add((tuple(offsets), tuple(sizes)))
    return sorted(boxes)


def shards_along(placement) -> bool:
    return placement.is_shard() or isinstance(placement, _StridedShard)  # _StridedShard is no Shard in torch 2.13


def dtensor_box(entry: Entry, rank: int) -> Box:
    """The box ``rank`` holds of a DTENSOR entry."""
    assert entry.mesh is not None  # every DTENSOR entry has one
    coordinate = entry.mesh.coordinate(rank)
    sizes, offsets = _compute_local_shape_and_global_offset(entry.size, entry.mesh.shape, list(coordinate),
                                                            entry.placements)
    return tuple(offsets), tuple(sizes)

