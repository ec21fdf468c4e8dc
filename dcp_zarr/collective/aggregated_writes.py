"""The writer's side of an aggregated save: each round, the parts this rank sends to aggregators, and the blocks it
aggregates, assembled from the parts it receives (and its own) and written as one chunk each.

The parts of a message are in one order on both sides (the round's units by key, then the pieces by offsets), and
each side knows every part's size from the plan, so a message is bare bytes. Blocks are assembled in host memory;
parts of tensors on a device travel on the group's device (transfer.py) and are copied to host when assembled.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch

from dcp_zarr.collective.aggregation import Aggregation, intersect, own_pieces, pieces
from dcp_zarr.collective.transfer import Group, aligned, as_message, padded
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.placement.boxes import Box
from dcp_zarr.placement.holdings import Holding, Merged
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.chunks import write_chunk
from dcp_zarr.store_io.scheduler import run_jobs

Held = dict[str, list[tuple[Box, torch.Tensor]]]  # fqn -> this rank's non-empty boxes of it, with their data


def write_aggregated(aggregation: Aggregation, entries: dict[str, Holding], specs: dict[str, ArraySpec],
                     held: Callable[[], Held], group: Group, storage: Storage, thread_count: int,
                     merged: Merged | None = None) -> list[str]:
    """Run every round of the save's aggregation on this rank; returns the chunk keys it wrote. Every rank calls
    it, with the same plan; an error on any rank (``held()``, this rank's non-empty boxes of the aggregated arrays
    with their data, included) is raised on every rank, at the check of the round it happened in."""
    rank = group.rank
    own: Held = {}  # the boxes of aggregated arrays this rank sends (and places itself, in the blocks it writes)
    failure: BaseException | None = None
    try:
        for fqn, boxes in held().items():
            chosen = set(own_pieces(entries[fqn], rank, [box for box, _ in boxes], merged))
            own[fqn] = sorted(((box, tensor) for box, tensor in boxes if box in chosen), key=lambda b: b[0])
    except Exception as exc:  # noqa: BLE001  (raised on every rank by the first round's check)
        failure = exc
    senders: dict[str, list] = {}  # fqn -> its pieces, for the blocks this rank aggregates
    written: list[str] = []
    for number, units in enumerate(aggregation.rounds):
        sends: dict[int, list[torch.Tensor]] = {}
        receives: dict[int, list[torch.Tensor]] = {}
        mine = [unit for unit in units if unit.owner == rank]
        incoming: dict[int, list] = defaultdict(list)  # sender -> [(fqn, block, part box)], in message order
        try:
            if failure is not None:
                raise failure
            outgoing: dict[int, list[torch.Tensor]] = defaultdict(list)
            for unit in units:
                fqn, block = unit.key
                if unit.owner == rank or fqn not in own:
                    continue
                rows = aggregation.arrays[fqn].block_rows(block)
                for box, tensor in own[fqn]:
                    part = intersect(box, rows)
                    if part is not None:
                        outgoing[unit.owner].append(_region(tensor, box, part))
            for unit in mine:
                fqn, block = unit.key
                if fqn not in senders:
                    senders[fqn] = sorted(pieces(entries[fqn], merged))
                rows = aggregation.arrays[fqn].block_rows(block)
                for piece in senders[fqn]:
                    part = intersect((piece.offsets, piece.sizes), rows)
                    if part is not None and piece.sender != rank:
                        incoming[piece.sender].append((fqn, block, part))
            sends = {peer: [torch.cat([padded(as_message(p, group.device)) for p in parts])]
                     for peer, parts in outgoing.items()}
            receives = {peer: [torch.empty(sum(aligned(_nbytes(entries[f], part)) for f, _, part in parts),
                                           dtype=torch.uint8, device=group.device)]
                        for peer, parts in incoming.items()}
        except Exception as exc:  # noqa: BLE001  (raised on every rank by the check below)
            failure = failure or exc
        group.check(failure, f"aggregated save, round {number + 1} of {len(aggregation.rounds)}")
        group.exchange(sends, receives)
        del sends
        try:
            if failure is not None:
                raise failure
            written += _write_blocks(mine, aggregation, entries, specs, own, incoming, receives, storage,
                                     thread_count)
        except Exception as exc:  # noqa: BLE001
            failure = exc
    group.check(failure, "aggregated save, the last round's writes")
    return written


def _write_blocks(units, aggregation: Aggregation, entries: dict[str, Holding], specs: dict[str, ArraySpec],
                  own: Held, incoming, receives, storage: Storage, thread_count: int) -> list[str]:
    """Assemble the blocks this rank aggregates in this round, from the parts received and its own, and write each
    as one chunk; returns their keys."""
    consumed: dict[int, int] = defaultdict(int)  # sender -> bytes of its message placed so far
    received: dict[tuple[str, int], list] = defaultdict(list)
    for sender, parts in incoming.items():
        for fqn, block, part in parts:
            n = _nbytes(entries[fqn], part)
            received[(fqn, block)].append((part, receives[sender][0][consumed[sender]: consumed[sender] + n]))
            consumed[sender] += aligned(n)
    jobs: list[tuple[int, Callable[[], None]]] = []
    keys = []
    for unit in units:
        fqn, block = unit.key
        entry, array = entries[fqn], aggregation.arrays[fqn]
        first, last = array.block_rows(block)
        assert entry.dtype is not None  # aggregated arrays are tensors
        assembled = torch.empty((last - first, *entry.size[1:]), dtype=entry.dtype)
        for part, payload in received[(fqn, block)]:
            _place(assembled, first, part, payload.view(entry.dtype).reshape(part[1]))
        for box, tensor in own.get(fqn, ()):
            part = intersect(box, (first, last))
            if part is not None:
                _place(assembled, first, part, _region(tensor, box, part))
        key = f"{specs[fqn].node}/{array.layout.chunk_key((block,) + (0,) * (len(entry.size) - 1))}"
        keys.append(key)
        # the spec's layout is the aggregation's, with the array's codec where it is compressed
        jobs.append((unit.nbytes, partial(write_chunk, storage, key, tensor_as_numpy(assembled), specs[fqn].layout)))
    run_jobs(jobs, storage.requests_in_flight(thread_count), storage.batch_bytes, name="dcp-zarr-aggregate",
             max_bytes_in_flight=storage.max_bytes_in_flight)
    return keys


def _region(tensor: torch.Tensor, box: Box, part: Box) -> torch.Tensor:
    """The part of a box's data (``tensor`` holds ``box``)."""
    return tensor[tuple(slice(o - b, o - b + n) for o, n, b in zip(part[0], part[1], box[0]))]


def _place(block: torch.Tensor, first_row: int, part: Box, values: torch.Tensor) -> None:
    (offsets, sizes) = part
    region = (slice(offsets[0] - first_row, offsets[0] - first_row + sizes[0]),
              *(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:])))
    block[region].copy_(values)


def _nbytes(entry: Holding, part: Box) -> int:
    assert entry.dtype is not None
    count = 1
    for n in part[1]:
        count *= n
    return count * entry.dtype.itemsize
