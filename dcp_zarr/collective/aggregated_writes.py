"""The writer's side of an aggregated save: each round, the parts this rank sends to aggregators, and the blocks it
aggregates, assembled from the parts it receives (and its own) and written as one chunk each.

In a save that records its chunks (incremental), a block that the earlier checkpoint recorded with a digest is looked
for before any data travels (``_link_unchanged``): each rank hashes its parts of such blocks and sends the digests
(16 bytes a part) to their aggregators, and an aggregator whose block's parts make the recorded digest
(format/chunk_record.parts_digest) links the earlier object (store_io/chunk_reuse.ChunkReuse.link_unchanged); one
all-reduce of a flag per such block then tells every rank which blocks still need their data, and the rounds carry
only those. So a frozen array costs its holders a hash and 16 bytes a part, not its bytes over the process group. A
block that travels goes through ``ChunkReuse.store`` as any other chunk, recorded with its parts' digest.

The parts of a message are in one order on both sides (the round's units by key, then the pieces by offsets), and
each side knows every part's size from the plan, so a message is bare bytes. Blocks are assembled in host memory;
parts of tensors on a device travel on the group's device (transfer.py) and are copied to host when assembled.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import numpy as np
import torch
import torch.distributed as dist

from dcp_zarr.collective.aggregation import Aggregation, Piece, intersect, own_pieces, pieces
from dcp_zarr.collective.rounds import Unit
from dcp_zarr.collective.transfer import Group, aligned, as_message, padded
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.chunk_record import UNHASHED, ArrayRecord, data_digest, parts_digest
from dcp_zarr.format.encoding import as_bytes
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.placement.boxes import Box
from dcp_zarr.placement.holdings import Holding, Merged
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.chunk_reuse import ChunkReuse
from dcp_zarr.store_io.chunks import write_chunk
from dcp_zarr.store_io.scheduler import run_jobs
from dcp_zarr.store_io.write_jobs import encoded_array_metadata

Held = dict[str, list[tuple[Box, torch.Tensor]]]  # fqn -> this rank's non-empty boxes of it, with their data
DIGEST_BYTES = 16


def write_aggregated(aggregation: Aggregation, entries: dict[str, Holding], specs: dict[str, ArraySpec],
                     held: Callable[[], Held], group: Group, storage: Storage, thread_count: int,
                     merged: Merged | None = None, reuse: ChunkReuse | None = None) -> tuple[list[str], int]:
    """Run every round of the save's aggregation on this rank; returns the chunk keys it stored and the bytes it
    wrote outside ``reuse`` (a save that records its chunks stores every block through it, which counts them). Every
    rank calls it, with the same plan; an error on any rank (``held()``, this rank's non-empty boxes of the aggregated
    arrays with their data, included) is raised on every rank, at the check of the round it happened in."""
    rank = group.rank
    own: Held = {}  # the boxes of aggregated arrays this rank sends (and places itself, in the blocks it writes)
    failure: BaseException | None = None
    try:
        for fqn, boxes in held().items():
            chosen = set(own_pieces(entries[fqn], rank, [box for box, _ in boxes], merged))
            own[fqn] = sorted(((box, tensor) for box, tensor in boxes if box in chosen), key=lambda b: b[0])
    except Exception as exc:  # noqa: BLE001  (raised on every rank by the first round's check)
        failure = exc
    senders: dict[str, list[Piece]] = {}  # fqn -> its pieces, for the blocks this rank aggregates
    written: list[str] = []
    rounds = aggregation.rounds
    if reuse is not None and reuse.earlier is not None:
        rounds, written = _link_unchanged(aggregation, entries, specs, own, failure, group, storage, thread_count,
                                          merged, reuse, senders)
    stored = 0
    for number, units in enumerate(rounds):
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
                rows = aggregation.arrays[fqn].block_rows(block)
                for piece in _pieces(senders, entries, fqn, merged):
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
        group.check(failure, f"aggregated save, round {number + 1} of {len(rounds)}")
        group.exchange(sends, receives)
        del sends
        try:
            if failure is not None:
                raise failure
            keys, nbytes = _write_blocks(mine, aggregation, entries, specs, own, incoming, receives, storage,
                                         thread_count, reuse, senders, merged)
            written += keys
            stored += nbytes
        except Exception as exc:  # noqa: BLE001
            failure = exc
    group.check(failure, "aggregated save, the last round's writes")
    return written, stored


def _link_unchanged(aggregation: Aggregation, entries: dict[str, Holding], specs: dict[str, ArraySpec], own: Held,
                    failure: BaseException | None, group: Group, storage: Storage, thread_count: int,
                    merged: Merged | None, reuse: ChunkReuse, senders: dict[str, list[Piece]]
                    ) -> tuple[list[list[Unit]], list[str]]:
    """Link the blocks that did not change since the earlier checkpoint, before any data travels (see the module's
    docstring); returns the rounds left, of the blocks that still need their data (alike on every rank), and the
    keys of the blocks this rank linked. Every rank calls it; a failure on any rank (``failure``: this rank's so
    far) is raised on every rank. ``senders``: the pieces of each array whose blocks this rank aggregates."""
    rank = group.rank
    earlier = {fqn: reuse.earlier_array(specs[fqn].node, encoded_array_metadata(specs[fqn]))
               for fqn in aggregation.arrays}
    candidates: list[tuple[Unit, ArrayRecord]] = []  # the blocks the record has a digest for, in key order
    listed = []
    for unit in sorted((unit for units in aggregation.rounds for unit in units), key=lambda u: u.key):
        fqn, block = unit.key
        record = earlier[fqn]
        previous = reuse.previous(record, block)
        if record is not None and previous is not None and previous.digest != UNHASHED:
            candidates.append((unit, record))
            listed.append(repr(unit.key).encode() + previous.digest)
    # Every rank read the earlier record for itself: ranks that read different ones (it was replaced meanwhile)
    # would wait for digests never sent, so then no block is looked for.
    if not group.same_everywhere(hashlib.blake2b(b"".join(listed), digest_size=16).digest()) or not candidates:
        return aggregation.rounds, []
    sends: dict[int, list[torch.Tensor]] = {}
    receives: dict[int, list[torch.Tensor]] = {}
    try:
        if failure is not None:
            raise failure
        outgoing: dict[int, list[bytes]] = defaultdict(list)
        expected: dict[int, int] = defaultdict(int)
        for unit, _ in candidates:
            fqn, block = unit.key
            rows = aggregation.arrays[fqn].block_rows(block)
            if unit.owner != rank:  # the digests of this rank's parts, in the order the data path sends them
                for box, tensor in own.get(fqn, ()):
                    part = intersect(box, rows)
                    if part is not None:
                        outgoing[unit.owner].append(_digest(_region(tensor, box, part)))
                continue
            for piece in _pieces(senders, entries, fqn, merged):
                if piece.sender != rank and intersect((piece.offsets, piece.sizes), rows) is not None:
                    expected[piece.sender] += 1
        sends = {peer: [torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).to(group.device)]
                 for peer, digests in outgoing.items()}
        receives = {peer: [torch.empty(count * DIGEST_BYTES, dtype=torch.uint8, device=group.device)]
                    for peer, count in expected.items()}
    except Exception as exc:  # noqa: BLE001  (raised on every rank by the check below)
        failure = exc
    group.check(failure, "aggregated save, the digests of the blocks the earlier checkpoint recorded")
    group.exchange(sends, receives)
    needed = torch.zeros(len(candidates) + 1, dtype=torch.uint8)  # 1: a block still needs its data; last: failed
    linked: list[str] = []
    try:
        digests = {peer: buffers[0].cpu().numpy().tobytes() for peer, buffers in receives.items()}
        taken: dict[int, int] = defaultdict(int)
        jobs: list[tuple[int, Callable[[], bool]]] = []
        slots: list[tuple[int, str]] = []
        for number, (unit, record) in enumerate(candidates):
            if unit.owner != rank:
                continue
            fqn, block = unit.key
            rows = aggregation.arrays[fqn].block_rows(block)
            mine = dict(own.get(fqn, ()))
            parts = []
            for piece in senders[fqn]:
                part = intersect((piece.offsets, piece.sizes), rows)
                if part is None:
                    continue
                if piece.sender == rank:
                    box = (piece.offsets, piece.sizes)
                    digest = _digest(_region(mine[box], box, part))
                else:
                    at = taken[piece.sender]
                    digest = digests[piece.sender][at * DIGEST_BYTES: (at + 1) * DIGEST_BYTES]
                    taken[piece.sender] = at + 1
                parts.append((part[0], part[1], digest))
            spec = specs[fqn]
            key = _block_key(spec, aggregation, fqn, block)
            jobs.append((0, partial(reuse.link_unchanged, storage, spec.node, block, key, spec.layout, record,
                                    parts_digest(parts))))
            slots.append((number, key))
        done = run_jobs(jobs, storage.requests_in_flight(thread_count), storage.batch_bytes, name="dcp-zarr-link")
        for (number, key), was_linked in zip(slots, done):
            if was_linked:
                linked.append(key)
            else:  # changed, or its earlier object is not the recorded one: written from its data
                needed[number] = 1
    except Exception as exc:  # noqa: BLE001  (raised on every rank below)
        failure = exc
        needed[-1] = 1
    needed = needed.to(group.device)
    dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group.group)
    flags = needed.tolist()
    if flags[-1]:
        group.check(failure, "aggregated save, linking the unchanged blocks")
    skipped = {unit.key for (unit, _), flag in zip(candidates, flags) if not flag}
    left = [unit for units in aggregation.rounds for unit in units if unit.key not in skipped]
    return aggregation.rounds_of(left), linked


def _pieces(senders: dict[str, list[Piece]], entries: dict[str, Holding], fqn: str, merged: Merged | None
            ) -> list[Piece]:
    """The array's pieces with their senders, in the order of every message (by offsets); made once a save."""
    if fqn not in senders:
        senders[fqn] = sorted(pieces(entries[fqn], merged))
    return senders[fqn]


def _digest(region: torch.Tensor) -> bytes:
    """The data digest of a part of a block, as its holder has it (copied to host from a device)."""
    return data_digest(as_bytes(tensor_as_numpy(region.detach().cpu())))


def _block_digest(block: np.ndarray, first_row: int, block_pieces: list[Piece], rows: tuple[int, int]) -> bytes:
    """An assembled block's digest (``parts_digest``), as its parts' holders compute it in ``_link_unchanged``."""
    parts = []
    for piece in block_pieces:
        part = intersect((piece.offsets, piece.sizes), rows)
        if part is not None:
            (offsets, sizes) = part
            region = (slice(offsets[0] - first_row, offsets[0] - first_row + sizes[0]),
                      *(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:])))
            parts.append((offsets, sizes, data_digest(as_bytes(block[region]))))
    return parts_digest(parts)


def _block_key(spec: ArraySpec, aggregation: Aggregation, fqn: str, block: int) -> str:
    layout = aggregation.arrays[fqn].layout
    return f"{spec.node}/{layout.chunk_key((block,) + (0,) * (len(layout.shape) - 1))}"


def _write_blocks(units, aggregation: Aggregation, entries: dict[str, Holding], specs: dict[str, ArraySpec],
                  own: Held, incoming, receives, storage: Storage, thread_count: int, reuse: ChunkReuse | None,
                  senders: dict[str, list], merged: Merged | None) -> tuple[list[str], int]:
    """Assemble the blocks this rank aggregates in this round, from the parts received and its own, and store each
    as one chunk (through ``reuse`` where given); returns their keys and the bytes written outside ``reuse``."""
    consumed: dict[int, int] = defaultdict(int)  # sender -> bytes of its message placed so far
    received: dict[tuple[str, int], list] = defaultdict(list)
    for sender, parts in incoming.items():
        for fqn, block, part in parts:
            n = _nbytes(entries[fqn], part)
            received[(fqn, block)].append((part, receives[sender][0][consumed[sender]: consumed[sender] + n]))
            consumed[sender] += aligned(n)
    jobs: list[tuple[int, Callable[[], int | None]]] = []
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
        spec = specs[fqn]
        key = _block_key(spec, aggregation, fqn, block)
        keys.append(key)
        # the spec's layout is the aggregation's, with the array's codec where it is compressed
        data = tensor_as_numpy(assembled)
        if reuse is None:
            jobs.append((unit.nbytes, partial(write_chunk, storage, key, data, spec.layout)))
        else:  # blocks cut dim 0 only: a block's number is its index in the grid's C order
            earlier = reuse.earlier_array(spec.node, encoded_array_metadata(spec))
            digest_of = partial(_block_digest, data, first, _pieces(senders, entries, fqn, merged), (first, last))
            jobs.append((unit.nbytes, partial(reuse.store, storage, spec.node, block, key, data, spec.layout, earlier,
                                              digest_of)))
    stored = run_jobs(jobs, storage.requests_in_flight(thread_count), storage.batch_bytes, name="dcp-zarr-aggregate",
                      max_bytes_in_flight=storage.max_bytes_in_flight)
    return keys, sum(n for n in stored if n is not None)


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
