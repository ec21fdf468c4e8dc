"""Each array's chunk layout, derived from how it is held: the layout DCP's deduplicated boxes would give.

``format/chunk_layout.chunk_layout_for_boxes`` takes every saved box; a rank planning alone has only its own. For a
DTensor the boxes follow from the global shape, the mesh shape and the placements, so ``dtensor_layout`` computes the
same grid from those: in closed form, O(1) in the world size, for plain ``Shard``s (FSDP, HSDP, TP, one dim split
several times) and FSDP2-over-TP's ``_StridedShard`` then ``Shard``; else from the boxes of every mesh coordinate
(boxes.py), enumerated once per kind of array (the arrays of a model have few shapes).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from functools import lru_cache

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.tensor import Replicate, Shard

from dcp_zarr.errors import InvalidEntryError
from dcp_zarr.format.chunk_layout import ChunkLayout, array_shard_layout, chunk_layout_for_boxes, inner_rows_for_chunk
from dcp_zarr.placement.boxes import (
    Box,
    dtensor_local_box,
    index_at,
    strided_split_factor,
    torch_chunk_piece,
    torch_chunks,
)
from dcp_zarr.placement.holdings import BOX, DTENSOR, EVERY_RANK, SHARDS, Holding


def entry_layout(entry: Holding, itemsize: int, inner_chunk_bytes: int, array_shards: bool,
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
    if 0 in size:  # every box is empty: nothing constrains the grid (chunk_layout_for_boxes' rule)
        chunk = tuple(max(n, 1) for n in size)
        return ChunkLayout(size, chunk, inner_rows_for_chunk(chunk, itemsize, inner_chunk_bytes)), 0
    splits = _splits_per_dim(len(size), mesh_shape, placements)
    grids = None if splits is None else [_dim_grid(n, steps) for n, steps in zip(size, splits)]
    if grids is None or None in grids:
        return _layout_of_boxes(size, dtensor_boxes(size, mesh_shape, placements), itemsize, inner_chunk_bytes,
                                array_shards)
    chunk = tuple(grid for grid, _ in grids)  # type: ignore[misc]  # None is handled above
    blocks = [count for _, count in grids]  # type: ignore[misc]
    layout = ChunkLayout(size, chunk, inner_rows_for_chunk(chunk, itemsize, inner_chunk_bytes))
    # array_shard_layout's conditions: at least two non-empty boxes, split along dim 0 only
    if array_shards and size and blocks[0] > 1 and all(b == 1 for b in blocks[1:]):
        rows = layout.inner_rows or layout.chunk_shape[0]
        layout = ChunkLayout(size, (-(-size[0] // rows) * rows, *size[1:]), rows, layout.separator)
    return layout, math.prod(blocks)


def _splits_per_dim(ndim: int, mesh_shape: tuple[int, ...], placements: tuple) -> list[list] | None:
    """The splits each tensor dim goes through, in DTensor's order: ``k`` for a plain ``Shard`` over k ranks (nested
    torch.chunk), ``("strided", m, k)`` for FSDP2-over-TP's ``_StridedShard(d, split_factor=k)`` over m ranks with
    the ``Shard(d)`` over k after it. None for anything else: the boxes are then enumerated."""
    splits: list[list] = [[] for _ in range(ndim)]
    strided: dict[int, tuple[int, int]] = {}  # dim -> (mesh size, split factor) of a _StridedShard waiting its Shard
    for n, placement in zip(mesh_shape, placements):
        split_factor = strided_split_factor(placement)
        if split_factor is not None:
            if placement.dim in strided:
                return None
            strided[placement.dim] = (n, split_factor)
        elif type(placement) is Shard:
            waiting = strided.pop(placement.dim, None)
            if waiting is None:
                splits[placement.dim].append(n)
            elif waiting[1] == n:
                splits[placement.dim].append(("strided", waiting[0], n))
            else:
                return None
        elif not (isinstance(placement, Replicate) or placement.is_partial()):
            return None
    return None if strided else splits


def _dim_grid(n: int, steps: list) -> tuple[int, int] | None:
    """(the grid along one dim, its non-empty pieces), or None when only DTensor itself can say."""
    if all(isinstance(k, int) for k in steps):
        return _nested_chunks(n, steps)
    if len(steps) == 1:
        _, m, k = steps[0]
        return _strided_grid(n, m, k)
    return None


def _strided_grid(n: int, m: int, k: int) -> tuple[int, int]:
    """(the grid, the non-empty pieces) of a dim under ``(_StridedShard(split_factor=k), Shard)`` on mesh dims of m
    and k, as DTensor computes each rank's piece: the dim is cut by torch.chunk into k chunks, rank i of the m holds
    the i-th torch.chunk piece of each (their indices, concatenated), and rank j of the k takes the j-th torch.chunk
    piece of those, reported (as DCP saves it) at its first index. The grid is chunk_layout_for_boxes' rule: the gcd
    of the pieces' inner boundaries.

    O(k * k) whatever m is: the ranks i fall into a few runs (split where a chunk's piece turns partial or empty)
    over which every boundary moves by a fixed step d from B0, so the run's boundaries B0 + t * d have the gcd of
    B0 and B0 + d: its first two ranks' (only a last end can reach n, which the rule leaves out). Walking every i
    instead is O(m) an array shape, which at thousands of ranks shows in a rank's planning
    (benchmarks/reports/planning.md, "One rank's planning, 8 vs 8,192 ranks, 2,000 tensors")."""
    chunks = torch_chunks(n, k)
    breaks = {0, m}
    for _, length in chunks:
        full = length // -(-length // m)  # the ranks whose piece of this chunk is whole
        breaks |= {min(full, m), min(full + 1, m)}
    gcd, count = 0, 0
    edges = sorted(breaks)
    for lo, hi in zip(edges, edges[1:]):
        pieces = [_strided_rank_pieces(chunks, m, k, i) for i in range(lo, min(lo + 2, hi))]
        count += (hi - lo) * len(pieces[0])
        for found in pieces:
            for offset, size in found:
                gcd = math.gcd(gcd, offset, offset + size if offset + size < n else 0)
    return (gcd or n), count


def _strided_rank_pieces(chunks: list[tuple[int, int]], m: int, k: int, i: int) -> list[tuple[int, int]]:
    """The non-empty (offset, size) pieces of the k ranks j at rank i of the m (_strided_grid's terms)."""
    held = [(start + a, b - a) for start, length in chunks for a, b in [torch_chunk_piece(length, m, i)] if b > a]
    total = sum(size for _, size in held)
    pieces = []
    for j in range(k):
        a, b = torch_chunk_piece(total, k, j)
        if b > a:
            pieces.append((index_at(held, a), b - a))
    return pieces


def _nested_chunks(n: int, splits: list[int]) -> tuple[int, int]:
    """(the gcd of the inner boundaries, or n if none; the non-empty pieces) of ``n`` cut by torch.chunk into
    ``splits[0]`` pieces, each of those into ``splits[1]``, ...: in O(len(splits)), however many pieces. The pieces
    are kept as counts per length (a split makes at most two new lengths); the inner boundaries are the running sums
    of the pieces but the last, so their gcd is the gcd of those pieces' lengths."""
    lengths = {n: 1}
    last = n  # the last non-empty piece: empty ones trail, so it is the last one's last piece
    for k in splits:
        cut: dict[int, int] = defaultdict(int)
        for length, count in lengths.items():
            size = -(-length // k)
            whole, rest = divmod(length, size)
            cut[size] += whole * count
            if rest:
                cut[rest] += count
        size = -(-last // k)
        last = last - (last // size) * size or size
        lengths = cut
    pieces = sum(lengths.values())
    if pieces < 2:
        return n, pieces
    gcd = 0
    for length, count in lengths.items():
        if count > 1 or length != last:
            gcd = math.gcd(gcd, length)
    return gcd, pieces


def dtensor_boxes(size: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> list[Box]:
    """Every distinct box of a DTensor, as DTensor computes each rank's (mesh dims that do not shard stay at 0)."""
    ranges = [range(n) if shards_along(placement) else range(1) for n, placement in zip(mesh_shape, placements)]
    boxes = set()
    for coordinate in itertools.product(*ranges):
        boxes.add(box_at(size, mesh_shape, placements, coordinate))
    return sorted(boxes)


def shards_along(placement) -> bool:
    return placement.is_shard() or strided_split_factor(placement) is not None


def dtensor_box(entry: Holding, rank: int) -> Box:
    """The box ``rank`` holds of a DTENSOR entry."""
    assert entry.mesh is not None  # every DTENSOR entry has one
    return box_at(entry.size, entry.mesh.shape, entry.placements, entry.mesh.coordinate(rank))


def box_at(size: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coordinate: tuple[int, ...]) -> Box:
    """boxes.py's arithmetic. A ``Partial`` holds the whole dim on every rank, as a ``Replicate`` does (DCP refuses
    to save one; a load target may be one); a placement boxes.py does not know is refused, naming it."""
    box = dtensor_local_box(size, mesh_shape, placements, coordinate)
    if box is None:
        whole = tuple(Replicate() if placement.is_partial() else placement for placement in placements)
        box = dtensor_local_box(size, mesh_shape, whole, coordinate)
    if box is None:
        unknown = [str(p) for p in placements if not (p.is_shard() or p.is_replicate() or p.is_partial()
                                                       or strided_split_factor(p) is not None)]
        raise InvalidEntryError(f"a DTensor of shape {size} on a mesh of shape {mesh_shape} has placements this "
                                f"version of dcp_zarr cannot place ({', '.join(unknown) or placements}); "
                                "pip install -U dcp-zarr")
    return box
