"""When the ranks' digests differ: one exchange of what differs, then the plan every rank makes from all of it.

Ranks can hold different keys for good reasons (a pipeline stage's own layers and their optimizer state, a key one
rank adds) and for bad ones (one key with two shapes). The coordinator's entries go to every rank (one broadcast);
each rank sends back only its entries that differ from them and the keys it lacks (one all-gather); every rank then
knows every rank's entries and plans alike:

* every tensor and value as the boxes the ranks hold (a DTensor's from its mesh and placements, once every rank of
  its mesh is seen holding it; a ShardedTensor's from its shards; others as sent), each distinct box written by
  one of its holders (placement/box_writers.py decides which), after checking that the boxes of one key do not
  overlap.

Keys whose entries disagree are refused with ``PlanMismatchError`` naming the keys and the ranks, on every rank.
"""

from __future__ import annotations

import math
from collections import defaultdict

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_zarr.errors import PlanMismatchError, ReplicaMismatchError
from dcp_zarr.placement.box_writers import exchange_writers
from dcp_zarr.placement.chunk_grids import Box, dtensor_box
from dcp_zarr.placement.holdings import BOX, DTENSOR, EVERY_RANK, SHARDS, TENSOR, Holding, Merged, signature
from dcp_zarr.planning.replicas import mismatch_message, ranks_text

_LISTED = 20


def exchange_entries(mine: dict[str, Holding], rank: int, world_size: int, group) -> list[dict[str, Holding]]:
    """Every rank's entries, from the coordinator's (sent once) and each rank's differences from them."""
    coordinator = [mine if rank == 0 else None]
    dist.broadcast_object_list(coordinator, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    base: dict[str, Holding] = coordinator[0]  # type: ignore[assignment]
    differences = ({fqn: e for fqn, e in mine.items() if fqn not in base or signature(base[fqn]) != signature(e)},
                   [fqn for fqn in base if fqn not in mine])
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, differences, group=group)
    every = []
    for extra, lacking in gathered:
        entries = {fqn: e for fqn, e in base.items() if fqn not in lacking}
        entries.update(extra)
        every.append(entries)
    return every


def merge(every: list[dict[str, Holding]], keep_first_replica: bool = False) -> Merged:
    """The plan of every rank's entries. ``keep_first_replica`` (``check_replicas="none"``): a plain tensor or value
    whose holders disagree in kind, shape or dtype is saved as the lowest rank holding it has it, as DCP's planning
    keeps one rank's copy, instead of being refused."""
    held: dict[str, list[tuple[int, Holding]]] = defaultdict(list)
    for rank, entries in enumerate(every):
        for fqn, entry in entries.items():
            held[fqn].append((rank, entry))
    problems: list[str] = []
    replicas_only = True  # every key refused is a plain tensor or value that each of its holders saves whole
    merged: dict[str, Holding] = {}
    box_holders: dict[MetadataIndex, list[int]] = defaultdict(list)
    sizes: dict[MetadataIndex, int] = {}
    boxes: dict[str, list[Box]] = {}
    for fqn, holders in held.items():
        kinds: dict[tuple, list[int]] = defaultdict(list)
        for rank, entry in holders:
            kinds[_comparable(entry)].append(rank)
        if len(kinds) > 1 and keep_first_replica and all(e.holding == EVERY_RANK for _, e in holders):
            first = _comparable(holders[0][1])
            holders = [(rank, e) for rank, e in holders if _comparable(e) == first]
            kinds = {first: [rank for rank, _ in holders]}
        if len(kinds) > 1:
            problems.append(f"{fqn!r}: " + "; ".join(f"{_describe(holders, ranks)} on {ranks_text(ranks)}"
                                                     for ranks in kinds.values()))
            replicas_only &= all(e.holding == EVERY_RANK for _, e in holders)
            continue
        entry = holders[0][1]
        merged[fqn] = entry
        missing = _missing_holders(entry, [rank for rank, _ in holders])
        if missing:
            problems.append(f"{fqn!r}: {missing}")
            replicas_only = False
            continue
        distinct: dict[Box, list[int]] = defaultdict(list)
        for rank, e in holders:
            for box in _boxes(e, rank):
                distinct[box].append(rank)
        if entry.kind == TENSOR and entry.holding != DTENSOR:  # a DTensor's boxes cannot overlap
            overlap = _overlap(list(distinct))
            if overlap:
                (a, ra), (b, rb) = ((box, distinct[box]) for box in overlap)
                problems.append(f"{fqn!r}: box {_box(a)} on {ranks_text(ra)} overlaps box {_box(b)} on "
                                f"{ranks_text(rb)}")
                replicas_only = False
                continue
            boxes[fqn] = sorted(distinct)
        itemsize = entry.dtype.itemsize if entry.dtype is not None else 1
        for (offsets, box_sizes), box_ranks in distinct.items():
            index = MetadataIndex(fqn, offsets) if entry.kind == TENSOR else MetadataIndex(fqn)  # as DCP's items
            box_holders[index] = box_ranks
            sizes[index] = math.prod(box_sizes) * itemsize
    if problems:
        if replicas_only:  # what DCP's planning refuses as replicas that differ (replicas.py): the same error
            raise ReplicaMismatchError(mismatch_message(problems))
        listed = "\n".join(f"  {p}" for p in problems[:_LISTED])
        more = f"\n  ... and {len(problems) - _LISTED} more" if len(problems) > _LISTED else ""
        raise PlanMismatchError(f"{len(problems)} state-dict key{'s' if len(problems) > 1 else ''} cannot be saved "
                                f"as the ranks hold {'them' if len(problems) > 1 else 'it'}, so nothing was "
                                f"written:\n{listed}{more}")
    writers, describers = exchange_writers(box_holders, sizes,
                                           frozenset(f for f, e in merged.items() if e.kind == TENSOR))
    return Merged(merged, boxes, writers, describers)


def _missing_holders(entry: Holding, ranks: list[int]) -> str:
    """What is wrong when ranks that must hold the key lack it (a DTensor's mesh, a ShardedTensor's shards)."""
    present = set(ranks)
    if entry.holding == DTENSOR:
        assert entry.mesh is not None  # every DTENSOR entry has one
        for rank in ranks:
            lacking = sorted(set(entry.mesh.slice_ranks(rank)) - present)
            if lacking:
                return f"a DTensor on a mesh of {ranks_text(entry.mesh.slice_ranks(rank))}, missing on " \
                       f"{ranks_text(lacking)}"
    elif entry.holding == SHARDS:
        lacking = sorted({r for _, _, r in entry.boxes} - present)
        if lacking:
            return f"a ShardedTensor with shards on {ranks_text(lacking)}, which lack the key"
    return ""


def _comparable(entry: Holding) -> tuple:
    """What must agree between holders: all of the signature, but that plain tensors and boxes both plan as boxes
    (a rank holding the whole tensor and ranks holding parts of it)."""
    holding = "boxes" if entry.holding in (EVERY_RANK, BOX) else entry.holding
    kept = signature(entry)[:6] + (holding,) + signature(entry)[7:9]
    return kept + (entry.boxes,) if entry.holding == SHARDS else kept


def _boxes(entry: Holding, rank: int) -> list[Box]:
    """The boxes ``rank`` holds of its ``entry``."""
    if entry.holding == DTENSOR:
        return [dtensor_box(entry, rank)]
    if entry.holding in (BOX, SHARDS):
        return [(offsets, sizes) for offsets, sizes, holder in entry.boxes if holder == rank]
    return [((0,) * len(entry.size), entry.size)]


def _overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two distinct boxes sharing an element, if any (empty boxes share none)."""
    held = [b for b in boxes if all(b[1])]
    for i, (a_off, a_size) in enumerate(held):
        for b_off, b_size in held[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size)):
                return (a_off, a_size), (b_off, b_size)
    return None


def _describe(holders: list[tuple[int, Holding]], ranks: list[int]) -> str:
    entry = next(e for r, e in holders if r == ranks[0])
    if entry.kind != TENSOR:
        return "a non-tensor value"
    kind = {DTENSOR: "DTensor", SHARDS: "ShardedTensor"}.get(entry.holding, "tensor")
    placements = f" {list(map(str, entry.placements))}" if entry.placements else ""
    return f"a {str(entry.dtype).removeprefix('torch.')} {kind}{placements} of shape {list(entry.size)}"


def _box(box: Box) -> str:
    offsets, sizes = box
    return f"at {list(offsets)} of {list(sizes)}"
