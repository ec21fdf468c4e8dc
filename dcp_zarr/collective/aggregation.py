"""Which arrays a save aggregates, how they are cut into blocks, and who sends which part of them to whom.

An array is aggregated when it is held in pieces by several ranks and its largest piece is smaller than the
writer's ``aggregate_below``: one object (or file) per rank per array is then many small requests, the pattern
object stores throttle and parallel file systems serve worst. Its pieces travel to aggregators, one per block, and
each block is one zarr chunk, written by its aggregator as one object: a shard of inner chunks when it is larger
than an inner chunk, plain zarr v3 either way.

Everything here is decided alike on every rank from the entries every rank agreed on (placement/), without a
message: the blocks and their aggregators (balanced by bytes over the world), the rank that sends each piece (one
of the ranks holding it), and the rounds (rounds.py).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_zarr.collective.rounds import Unit, pack_rounds
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.placement.box_writers import balanced, box_holders
from dcp_zarr.placement.boxes import Box, dtensor_local_box
from dcp_zarr.placement.chunk_grids import box_at, dtensor_layout, shards_along
from dcp_zarr.placement.holdings import BOX, DTENSOR, SHARDS, TENSOR, Holding, Merged


class AggregatedArray(NamedTuple):
    fqn: str
    layout: ChunkLayout  # blocks are its chunks, cut along dim 0 only
    aggregators: tuple[int, ...]  # the rank assembling and writing each block

    def block_rows(self, block: int) -> tuple[int, int]:
        rows = self.layout.chunk_shape[0] if self.layout.shape else 1
        return block * rows, min((block + 1) * rows, self.layout.shape[0] if self.layout.shape else 1)


class Piece(NamedTuple):
    """One distinct box of an aggregated array and the rank that sends it (one of the ranks holding it)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    sender: int


class Aggregation(NamedTuple):
    arrays: dict[str, AggregatedArray]
    rounds: list[list[Unit]]  # unit key: (fqn, block); owner: the block's aggregator
    budget: int = 0  # the bytes of blocks an aggregator holds in a round (rounds.pack_rounds)

    def rounds_of(self, units: list[Unit]) -> list[list[Unit]]:
        """``units`` (some of this aggregation's, alike on every rank) packed into rounds as ``rounds`` are."""
        return pack_rounds(units, self.budget)


def aggregated_layout(shape: tuple[int, ...], itemsize: int, inner_chunk_bytes: int, block_bytes: int) -> ChunkLayout:
    """Blocks of whole rows of about ``block_bytes``, each a shard of inner chunks of about ``inner_chunk_bytes``
    (or one plain chunk when the block is no larger than an inner chunk); the last block padded to whole inner
    chunks, as zarr wants a shard a multiple of its inner chunk."""
    if not shape or 0 in shape:
        return ChunkLayout(shape, tuple(max(n, 1) for n in shape), 0)
    row_bytes = max(math.prod(shape[1:]) * itemsize, 1)
    if shape[0] * row_bytes <= inner_chunk_bytes:
        return ChunkLayout(shape, shape, 0)
    inner = max(1, min(shape[0], inner_chunk_bytes // row_bytes))
    rows = max(inner, (block_bytes // row_bytes) // inner * inner)
    if rows >= shape[0]:
        rows = -(-shape[0] // inner) * inner
    if rows == inner:  # one inner chunk per block: plain chunks, no index
        return ChunkLayout(shape, (rows, *shape[1:]), 0)
    return ChunkLayout(shape, (rows, *shape[1:]), inner)


def plan_aggregation(entries: dict[str, Holding], world_size: int, below: int, inner_chunk_bytes: int,
                     block_bytes: int, merged: Merged | None = None) -> Aggregation:
    """The arrays of ``entries`` to aggregate and the rounds of their blocks; ``merged``: the plan of an exchange
    (planning/exchange.py), when the ranks differed."""
    arrays: dict[str, AggregatedArray] = {}
    if below <= 0 or world_size < 2:
        return Aggregation(arrays, [])
    blocks: list[tuple[tuple[str, int], int]] = []
    largest: dict[str, int] = {}
    for fqn, entry in entries.items():
        if entry.kind != TENSOR or entry.dtype is None or len(entry.size) == 0 or 0 in entry.size:
            continue
        itemsize = entry.dtype.itemsize
        found = _largest_piece(entry, itemsize, merged.boxes if merged else None)
        if found is None or found[1] < 2 or found[0] >= below:
            continue
        largest[fqn] = found[0]
        layout = aggregated_layout(entry.size, itemsize, inner_chunk_bytes, block_bytes)
        row_bytes = math.prod(entry.size[1:]) * itemsize
        count = layout.grid_shape[0]
        for block in range(count):
            first = block * layout.chunk_shape[0]
            blocks.append(((fqn, block), (min(entry.size[0], first + layout.chunk_shape[0]) - first) * row_bytes))
        arrays[fqn] = AggregatedArray(fqn, layout, ())
    owners = balanced(blocks, world_size)
    units = []
    for (fqn, block), nbytes in blocks:
        units.append(Unit((fqn, block), owners[(fqn, block)], nbytes, min(largest[fqn], nbytes)))
    for fqn, array in arrays.items():
        arrays[fqn] = array._replace(aggregators=tuple(owners[(fqn, b)] for b in range(array.layout.grid_shape[0])))
    return Aggregation(arrays, pack_rounds(units, block_bytes), block_bytes)


def _largest_piece(entry: Holding, itemsize: int, boxes: dict[str, list[Box]] | None) -> tuple[int, int] | None:
    """(bytes of the largest piece, count of non-empty pieces), or None for holdings not aggregated."""
    if boxes is not None and entry.fqn in boxes:  # an exchange knows them
        held = [sizes for _, sizes in boxes[entry.fqn] if all(sizes)]
    elif entry.holding == DTENSOR:
        assert entry.mesh is not None  # every DTENSOR entry has one
        _, count = dtensor_layout(entry.size, entry.mesh.shape, entry.placements, itemsize, 1 << 62, False)
        first = dtensor_local_box(entry.size, entry.mesh.shape, entry.placements, (0,) * len(entry.mesh.shape))
        if first is None:  # placements boxes.py does not know (DCP refuses Partial): not aggregated
            return None
        return math.prod(first[1]) * itemsize, count  # torch.chunk's first piece is the largest along every dim
    elif entry.holding in (SHARDS, BOX):
        held = [sizes for _, sizes, _ in entry.boxes if all(sizes)]
    else:
        return None
    return (max((math.prod(s) for s in held), default=0) * itemsize, len(held))


def pieces(entry: Holding, merged: Merged | None = None) -> list[Piece]:
    """Every distinct non-empty box of an aggregated array with the rank sending it: for the aggregators."""
    if merged is not None and entry.fqn in merged.boxes:
        return [Piece(o, s, merged.writers[MetadataIndex(entry.fqn, o)]) for o, s in merged.boxes[entry.fqn]
                if all(s)]
    if entry.holding in (SHARDS, BOX):
        return [Piece(o, s, r) for o, s, r in entry.boxes if all(s)]
    assert entry.holding == DTENSOR and entry.mesh is not None
    mesh, placements = entry.mesh, entry.placements
    ranges = [range(n) if shards_along(p) else range(1) for n, p in zip(mesh.shape, placements)]
    found: dict[Box, Piece] = {}
    for coordinate in itertools.product(*ranges):
        offsets, sizes = box_at(entry.size, mesh.shape, placements, coordinate)
        if not all(sizes) or (offsets, sizes) in found:
            continue
        if merged is not None:  # the ranks that hold it, as the exchange found them
            sender = merged.writers[MetadataIndex(entry.fqn, offsets)]
        else:
            sender = _sender(entry.fqn, offsets, box_holders(mesh, placements, mesh.ranks_at(coordinate)[0]))
        found[(offsets, sizes)] = Piece(offsets, sizes, sender)
    return list(found.values())


def own_pieces(entry: Holding, rank: int, held: Sequence[Box], merged: Merged | None = None) -> list[Box]:
    """The boxes of ``held`` (this rank's non-empty boxes of an aggregated array) that this rank sends."""
    if merged is not None:
        return [b for b in held if merged.writers[MetadataIndex(entry.fqn, b[0])] == rank]
    if entry.holding in (SHARDS, BOX):
        return list(held)
    assert entry.holding == DTENSOR and entry.mesh is not None
    holders = box_holders(entry.mesh, entry.placements, rank)
    return [b for b in held if _sender(entry.fqn, b[0], holders) == rank]


def _sender(fqn: str, offsets: tuple[int, ...], holders: tuple[int, ...]) -> int:
    """One of ``holders``, spread over arrays and boxes by a hash every process computes alike (not ``hash``)."""
    if len(holders) == 1:
        return holders[0]
    return holders[zlib.crc32(f"{fqn}|{list(offsets)}".encode()) % len(holders)]


def intersect(box: Box, rows: tuple[int, int]) -> Box | None:
    """The part of ``box`` within rows [a, b) of its array, or None."""
    (offsets, sizes), (a, b) = box, rows
    lo, hi = max(offsets[0], a), min(offsets[0] + sizes[0], b)
    if lo >= hi:
        return None
    return (lo, *offsets[1:]), (hi - lo, *sizes[1:])
