"""Who writes what: one writer for every box several ranks hold, and one rank for each array's ``zarr.json``.

Every rank makes these choices alone, from entries every rank sees alike, so they agree without a message:

* an ``EVERY_RANK`` tensor goes to one rank of the world, the largest first, each to the rank with the fewest bytes
  so far (ties: the lowest rank), as DCP's deduplication balances them; every value goes to DCP's coordinator;
* a replicated DTensor box (``Replicate`` placements, HSDP's replica groups) goes to one rank of the ranks holding
  it, balanced the same way over the arrays of one mesh and placement pattern: each rank of such a group sees the
  same arrays with boxes of the same sizes;
* a DTensor array's ``zarr.json`` is written by the ranks of its root mesh in turn, in key order.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple, TypeVar

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_zarr.placement.chunk_grids import shards_along
from dcp_zarr.placement.holdings import DTENSOR, EVERY_RANK, TENSOR, VALUE, Holding, MeshSlice

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
    every = [(fqn, entry.nbytes) for fqn, entry in entries.items()
             if entry.holding == EVERY_RANK and entry.kind == TENSOR]
    for fqn, writer in balanced(every, world_size).items():
        if writer == rank:
            writes.add(fqn)
            describes.add(fqn)
    if coordinator:
        writes.update(fqn for fqn, entry in entries.items() if entry.kind == VALUE)
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
