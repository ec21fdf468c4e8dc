"""Who writes what: one writer for every box several ranks hold, and one rank for each array's ``zarr.json``. Every
way a save is planned asks here, and nowhere else decides it.

A save planned locally: every rank makes these choices alone, from entries every rank sees alike, so they agree
without a message (``rank_decisions``):

* an ``EVERY_RANK`` tensor goes to one rank of the world, the largest first, each to the rank with the fewest bytes
  so far (ties: the lowest rank), as DCP's deduplication balances them; every value goes to DCP's coordinator, and
  so does every ``EVERY_RANK`` tensor of one element that its array's fill_value can hold (format/fill_values.py:
  the coordinator puts it in the manifest, which a value sent to it would grow every rank's report with);
* a replicated DTensor box (``Replicate`` placements, HSDP's replica groups) goes to one rank of the ranks holding
  it, balanced the same way over the arrays of one mesh and placement pattern: each rank of such a group sees the
  same arrays with boxes of the same sizes;
* a DTensor array's ``zarr.json`` is written by the ranks of its root mesh in turn, in key order.

After an exchange (ranks that differ, planning/exchange.py), every distinct box goes to one of its holders, the
largest first, each to the holder with the fewest bytes so far, and an array's ``zarr.json`` to the writer of its
first box (``exchange_writers``, ``exchange_decisions``). An array aggregated (collective/aggregation.py) is written
by its aggregators, not by the holders of its boxes, and described by the aggregator of its first block
(``without_aggregated``). A save DCP plans: DCP's deduplication chose each box's writer, and an array's ``zarr.json``
goes to the holder that describes fewest arrays so far (``describing_ranks``).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import defaultdict
from collections.abc import Container, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import NamedTuple, TypeVar

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_zarr.format.fill_values import may_hold_in_fill
from dcp_zarr.format.torch_arrays import zarr_dtype_name
from dcp_zarr.placement.chunk_grids import shards_along
from dcp_zarr.placement.holdings import DTENSOR, EVERY_RANK, TENSOR, VALUE, Holding, Merged, MeshSlice

Key = TypeVar("Key", str, MetadataIndex, tuple)


def balanced(weights: Sequence[tuple[Key, int]], bins: int) -> dict[Key, int]:
    """key -> bin: the largest first, each to the bin with the fewest bytes so far (ties: the lowest bin)."""
    order = sorted(weights, key=lambda w: (-w[1], str(w[0])))
    if len(order) <= bins:  # every bin still empty when its turn comes: no heap of 8,192 bins for 800 keys
        return {key: i for i, (key, _) in enumerate(order)}
    heap = [(0, b) for b in range(bins)]
    chosen: dict[Key, int] = {}
    for key, nbytes in order:
        load, b = heapq.heappop(heap)
        chosen[key] = b
        heapq.heappush(heap, (load + max(nbytes, 1), b))
    return chosen


@lru_cache(maxsize=1024)
def box_holders(mesh: MeshSlice, placements: tuple, rank: int) -> tuple[int, ...]:
    """The ranks holding the same box of a DTensor as ``rank``: its coordinate, varied along the mesh dims that do
    not shard, on every slice of the root mesh (sorted, so every holder lists them alike)."""
    coordinate = mesh.coordinate(rank)
    free = [d for d, p in enumerate(placements) if not shards_along(p) and mesh.shape[d] > 1]
    holders = []
    for values in itertools.product(*(range(mesh.shape[d]) for d in free)):
        point = list(coordinate)
        for d, v in zip(free, values):
            point[d] = v
        holders.extend(mesh.ranks_at(point))
    return tuple(sorted(holders))


def replica_group(entry: Holding, rank: int) -> str:
    """A name for the ranks holding ``rank``'s box of ``entry`` (the same on each of them)."""
    if entry.holding == EVERY_RANK:
        return "every rank"
    assert entry.mesh is not None  # only EVERY_RANK and DTENSOR entries are replicated without an exchange
    return _holders_name(entry.mesh, entry.placements, rank)


@lru_cache(maxsize=1024)
def _holders_name(mesh: MeshSlice, placements: tuple, rank: int) -> str:
    # by (mesh, placements, rank), hashed by the mesh's token: the holder tuple of an HSDP box can be 1,024 ranks
    return _group_name(box_holders(mesh, placements, rank))


@lru_cache(maxsize=1024)
def _group_name(holders: tuple[int, ...]) -> str:
    """The holder set itself, short: boxes of two placements can share a first rank and a count, not the set."""
    shown = f"ranks {holders[0]}.." if len(holders) > 1 else f"rank {holders[0]}"
    return f"{shown} ({len(holders)}, {hashlib.blake2b(repr(holders).encode(), digest_size=6).hexdigest()})"


class Decisions(NamedTuple):
    """What one rank writes: the keys of its entries it writes whole (or, after an exchange, the item indexes), and
    the arrays whose ``zarr.json`` it writes."""

    writes: frozenset[str | MetadataIndex]
    describes: frozenset[str]


def rank_decisions(entries: dict[str, Holding], rank: int, world_size: int, box_nbytes: dict[str, int],
                   coordinator: bool) -> Decisions:
    """This rank's writes among its ``entries`` (the structure every rank agreed on). ``box_nbytes``: the bytes of
    this rank's box of each tensor entry; ``coordinator``: whether this rank is DCP's coordinator, which writes every
    value (it puts each in the manifest: a value sent to it would grow the results DCP gathers from every rank,
    which are padded to the largest)."""
    writes: set[str | MetadataIndex] = set()
    describes: set[str] = set()
    every = [fqn for fqn, entry in entries.items() if entry.holding == EVERY_RANK and entry.kind == TENSOR]
    in_fill = {fqn for fqn in every if _fill_may_hold(entries[fqn])}
    for fqn, writer in balanced([(f, entries[f].nbytes) for f in every if f not in in_fill], world_size).items():
        if writer == rank:
            writes.add(fqn)
            describes.add(fqn)
    if coordinator:
        writes.update(fqn for fqn, entry in entries.items() if entry.kind == VALUE)
        writes.update(in_fill)
        describes.update(in_fill)
    # by (mesh, placements) first: an HSDP box's holders are 1,024 ranks, a tuple too long to hash once per entry
    holdings: dict[tuple[MeshSlice, tuple], list[str]] = {}
    on_mesh: dict[MeshSlice, list[str]] = {}
    for fqn, entry in entries.items():
        if entry.holding == DTENSOR:
            assert entry.mesh is not None  # every DTENSOR entry has one
            holdings.setdefault((entry.mesh, entry.placements), []).append(fqn)
            on_mesh.setdefault(entry.mesh, []).append(fqn)
        elif entry.holding != EVERY_RANK:  # SHARDS (one holder per shard); BOX never gets here (exchange.py)
            writes.add(fqn)
            if min(r for _, _, r in entry.boxes) == rank:
                describes.add(fqn)
    patterns: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    for (mesh, placements), fqns in holdings.items():
        holders = box_holders(mesh, placements, rank)
        if len(holders) == 1:
            writes.update(fqns)
        else:
            patterns.setdefault(holders, []).extend((fqn, box_nbytes.get(fqn, 0)) for fqn in fqns)
    for holders, weights in patterns.items():
        for fqn, j in balanced(weights, len(holders)).items():
            if holders[j] == rank:
                writes.add(fqn)
    for mesh, fqns in on_mesh.items():
        ranks = mesh.root.ranks
        for k, fqn in enumerate(sorted(fqns)):
            if ranks[k % len(ranks)] == rank:
                describes.add(fqn)
    return Decisions(frozenset(writes), frozenset(describes))


def _fill_may_hold(entry: Holding) -> bool:
    """Whether ``entry`` is one element of a dtype its array's fill_value can hold (format/fill_values.py)."""
    return entry.dtype is not None and may_hold_in_fill(entry.size, zarr_dtype_name(entry.dtype))


def exchange_writers(holders: Mapping[MetadataIndex, list[int]], sizes: Mapping[MetadataIndex, int],
                     tensors: frozenset[str]) -> tuple[dict[MetadataIndex, int], dict[str, int]]:
    """(box -> its writer, array -> the rank writing its zarr.json) of every rank's boxes after an exchange: the
    largest box first, each to the holder with the fewest bytes so far; an array described by its first box's
    writer. ``tensors``: the keys that are arrays (values have no zarr.json of their own)."""
    load: dict[int, int] = defaultdict(int)
    writers: dict[MetadataIndex, int] = {}
    for index in sorted(holders, key=lambda i: (-sizes[i], i.fqn, tuple(i.offset or ()))):
        writer = min(holders[index], key=lambda r: (load[r], r))
        load[writer] += max(sizes[index], 1)
        writers[index] = writer
    describers: dict[str, int] = {}
    for index in sorted(writers, key=lambda i: (i.fqn, tuple(i.offset or ()))):
        if index.fqn in tensors:
            describers.setdefault(index.fqn, writers[index])
    return writers, describers


def exchange_decisions(merged: Merged, rank: int) -> Decisions:
    """``rank``'s writes (item indexes) and descriptions in the plan of an exchange."""
    writes = frozenset(index for index, writer in merged.writers.items() if writer == rank)
    return Decisions(writes, frozenset(fqn for fqn, describer in merged.describers.items() if describer == rank))


def without_aggregated(decisions: Decisions, first_aggregators: Mapping[str, int], rank: int) -> Decisions:
    """``decisions`` without the aggregated arrays' boxes, which their aggregators write; each aggregated array's
    zarr.json is written by the aggregator of its first block (``first_aggregators``: array -> that rank)."""
    if not first_aggregators:
        return decisions
    writes = frozenset(w for w in decisions.writes if (w if isinstance(w, str) else w.fqn) not in first_aggregators)
    describes = frozenset(f for f in decisions.describes if f not in first_aggregators)
    return Decisions(writes, describes | {f for f, first in first_aggregators.items() if first == rank})


def describing_ranks(holders_by_rank: Iterable[Iterable[str]], arrays: Container[str]) -> dict[str, int]:
    """Array -> the one rank that writes its ``zarr.json``, in a save DCP planned (``holders_by_rank``: the keys of
    each rank's items, in plan order): of the ranks holding part of the array, the one that describes fewest arrays
    so far. Sharded arrays are held by every rank, and the first holder of each (rank 0) would write all their
    metadata, making every save wait on rank 0's ``write_data`` (benchmarks/reports/performance.md, "Many entries,
    files and requests": "Balanced metadata, fewer opens")."""
    holders: dict[str, list[int]] = defaultdict(list)
    world_size = 0
    for rank, fqns in enumerate(holders_by_rank):
        world_size = rank + 1
        for fqn in fqns:
            if fqn in arrays and (not holders[fqn] or holders[fqn][-1] != rank):
                holders[fqn].append(rank)
    load = [0] * world_size
    chosen: dict[str, int] = {}
    for fqn, ranks in holders.items():
        rank = min(ranks, key=lambda r: (load[r], r))
        load[rank] += 1
        chosen[fqn] = rank
    return chosen
