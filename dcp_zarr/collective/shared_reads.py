"""Reads done once: a region several ranks of a load need is read from storage by one of them and sent to the
others, and small pieces of one stored chunk are read with it, by one rank, and sent to the ranks needing them.

From the ``Need`` of every rank (needs.py), alike on every rank, each need is read one of three ways:

* ``REGION``: a box several ranks need whole (a plain tensor every rank loads, a DTensor's box held by replicas:
  HSDP's replica groups, ``Replicate`` placements, DDP) is a unit read by one of those ranks (balanced by bytes
  among the ranks of each holder set) and sent to the others;
* ``CHUNKS``: a DTensor whose boxes are small (under the reader's ``read_once_below``) is read a stored chunk at
  a time, each chunk by one rank of the world (balanced by bytes), which sends every rank its piece of it: one
  request per stored chunk instead of one per piece;
* ``DIRECT``: boxes that are large and held by one rank each are read by that rank alone: no other rank needs them,
  and at their size a request each costs little.

Units larger than the round budget are cut into row blocks (at the stored layout's chunk or inner-chunk rows), so a
reader holds at most about the budget at once. A receiver receives straight into its state dict's tensor where the
part is contiguous there, else into a staging buffer it then copies from.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from functools import lru_cache
from typing import NamedTuple

from dcp_zarr.collective.needs import Need
from dcp_zarr.collective.rounds import Unit, pack_rounds
from dcp_zarr.format.dtype_table import STORED_DTYPES
from dcp_zarr.format.manifest import TensorEntry
from dcp_zarr.placement.box_writers import balanced, box_holders
from dcp_zarr.placement.boxes import Box
from dcp_zarr.placement.chunk_grids import box_at, shards_along
from dcp_zarr.placement.holdings import DTENSOR, EVERY_RANK, MeshSlice

REGION, CHUNKS, DIRECT = "region", "chunks", "direct"


class UnitInfo(NamedTuple):
    dest: str  # the need this unit serves
    box: Box  # the unit's region of the array (global coordinates)
    mode: str  # REGION or CHUNKS


class SharedReads:
    """The shared part of one load, the same on every rank: units, their readers and rounds, and who receives what.
    ``needs``: every rank's (identical) needs; ``entries``: the manifest's."""

    def __init__(self, needs: dict[str, Need], entries: dict, world_size: int, read_once_below: int, budget: int):
        self.needs = needs
        self.world_size = world_size
        self.modes: dict[str, str] = {}
        self.info: dict[tuple, UnitInfo] = {}
        by_holders: dict[tuple[int, ...], list[tuple[tuple, int]]] = defaultdict(list)
        chunk_units: list[tuple[tuple, int]] = []
        for dest in sorted(needs):
            need = needs[dest]
            entry = entries.get(need.array)
            # (an array kept in its fill_value is read by no request: each rank fills its own)
            if world_size < 2 or not isinstance(entry, TensorEntry) or 0 in need.size or entry.fill is not None:
                self.modes[dest] = DIRECT
                continue
            itemsize = STORED_DTYPES[entry.dtype][0].itemsize
            chunk_shape = entry.chunk_shape or tuple(entry.shape)
            step = entry.inner_chunk_rows or (chunk_shape[0] if chunk_shape else 1)
            granule = math.prod(chunk_shape[1:]) * step if chunk_shape else 1
            mode = self.modes[dest] = _mode(need, itemsize, read_once_below, granule)
            if mode == REGION:
                for box, holders in _distinct_boxes(need, world_size):
                    for part in _row_blocks(box, step, itemsize, budget):
                        key = (need.array, dest, REGION, part[0])
                        self.info[key] = UnitInfo(dest, part, REGION)
                        by_holders[holders].append((key, _nbytes(part, itemsize)))
            elif mode == CHUNKS:
                for chunk in _chunks(need.size, chunk_shape):
                    for part in _row_blocks(chunk, step, itemsize, budget):
                        key = (need.array, dest, CHUNKS, part[0])
                        self.info[key] = UnitInfo(dest, part, CHUNKS)
                        chunk_units.append((key, _nbytes(part, itemsize)))
        units = []
        for holders, weights in by_holders.items():
            sizes = dict(weights)
            units += [Unit(key, holders[j], sizes[key], 0) for key, j in balanced(weights, len(holders)).items()]
        sizes = dict(chunk_units)
        units += [Unit(key, owner, sizes[key], 0) for key, owner in balanced(chunk_units, world_size).items()]
        self.rounds = pack_rounds(units, budget)
        self._units_of: dict[str, list[tuple]] = defaultdict(list)  # dest -> its units, in key order
        for key in sorted(self.info):
            self._units_of[key[1]].append(key)

    def shared(self, dest: str) -> bool:
        return self.modes.get(dest, DIRECT) != DIRECT

    def parts_for(self, rank: int, dest: str) -> dict[tuple, Box]:
        """Unit key -> the part of it that brings ``rank`` (some of) its region of ``dest``."""
        region = self.needs[dest].region(rank) if self.shared(dest) else None
        if region is None:
            return {}
        found = {}
        for key in self._units_of[dest]:
            part = _intersect(self.info[key].box, region)
            if part is not None:
                found[key] = part
        return found

    def receivers(self, key: tuple) -> list[tuple[int, Box]]:
        """(rank, part) of every rank that needs a part of the unit ``key``, the unit's reader included, in rank
        order: for its reader."""
        info = self.info[key]
        need = self.needs[info.dest]
        found = []
        if info.mode == REGION:
            for box, holders in _distinct_boxes(need, self.world_size):
                if _inside(info.box, box):
                    return [(r, info.box) for r in holders]
            return []
        for box, holders in _distinct_boxes(need, self.world_size):
            part = _intersect(box, info.box)
            if part is not None:
                found += [(r, part) for r in holders]
        return sorted(found)


def _mode(need: Need, itemsize: int, read_once_below: int, granule: int) -> str:
    """How ``need`` is read; ``granule``: the elements of the smallest piece of the array one read can fetch (an
    inner chunk of a shard, else a whole chunk)."""
    if need.holding == EVERY_RANK:
        return REGION
    assert need.holding == DTENSOR and need.mesh is not None
    largest = math.prod(box_at(need.size, need.mesh.shape, need.placements, (0,) * len(need.mesh.shape))[1])
    if largest * itemsize < read_once_below:  # torch.chunk's first piece is the largest
        return CHUNKS
    if len(box_holders(need.mesh, need.placements, need.mesh.root.ranks[0])) > 1:
        # replicas: each box read by one of its holders; by the stored chunk where a chunk, read whole, spans
        # several boxes (each box's reader would read all of it)
        return CHUNKS if granule > largest else REGION
    return DIRECT


def _distinct_boxes(need: Need, world_size: int) -> list[tuple[Box, tuple[int, ...]]]:
    """Every distinct non-empty box of a need, with the ranks needing it (sorted)."""
    if need.holding == EVERY_RANK:
        return [(((0,) * len(need.size), need.size), tuple(range(world_size)))]
    assert need.mesh is not None
    return _dtensor_boxes(need.size, need.mesh, need.placements)


@lru_cache(maxsize=256)
def _dtensor_boxes(size: tuple[int, ...], mesh: MeshSlice, placements: tuple) -> list[tuple[Box, tuple[int, ...]]]:
    ranges = [range(n) if shards_along(p) else range(1) for n, p in zip(mesh.shape, placements)]
    found: dict[Box, tuple[int, ...]] = {}
    for coordinate in itertools.product(*ranges):
        box = box_at(size, mesh.shape, placements, coordinate)
        if all(box[1]) and box not in found:
            found[box] = box_holders(mesh, placements, mesh.ranks_at(coordinate)[0])
    return sorted(found.items())


def _chunks(size: tuple[int, ...], chunk_shape: tuple[int, ...]) -> list[Box]:
    ranges = [range(0, n, c) for n, c in zip(size, chunk_shape)]
    return [(tuple(start), tuple(min(c, n - o) for o, c, n in zip(start, chunk_shape, size)))
            for start in itertools.product(*ranges)]


def _row_blocks(box: Box, step: int, itemsize: int, budget: int) -> list[Box]:
    """``box`` cut along dim 0 into blocks of about ``budget`` bytes, at multiples of ``step`` rows of the array."""
    offsets, sizes = box
    if not sizes or budget <= 0:
        return [box]
    row_bytes = max(math.prod(sizes[1:]) * itemsize, 1)
    if sizes[0] * row_bytes <= budget:
        return [box]
    rows = max(step, (budget // row_bytes) // step * step)
    cuts = list(range(offsets[0] - offsets[0] % rows + rows, offsets[0] + sizes[0], rows))
    edges = [offsets[0], *cuts, offsets[0] + sizes[0]]
    return [((a, *offsets[1:]), (b - a, *sizes[1:])) for a, b in zip(edges, edges[1:])]


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _inside(inner: Box, outer: Box) -> bool:
    return all(o <= i and i + n <= o + m for i, n, o, m in zip(inner[0], inner[1], outer[0], outer[1]))


def _nbytes(box: Box, itemsize: int) -> int:
    return math.prod(box[1]) * itemsize
