"""The rounds of a load's shared reads (shared_reads.py), on every rank: each reader reads its units of the round,
then every rank sends and receives the round's parts, receiving straight into the tensors being loaded where it
can. A rank that failed to read stops every rank at the next round (transfer.py)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch

from dcp_zarr.collective.shared_reads import SharedReads
from dcp_zarr.collective.transfer import Group, aligned, as_message, padded
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.placement.boxes import Box
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.chunks import RegionReader
from dcp_zarr.store_io.scheduler import run_jobs

# Parts smaller than this share one message per pair of ranks in a round: a message of its own has a fixed cost in
# gloo that outweighs copying a part this small in and out of the shared message.
PACKED_BELOW = 64 << 10

# dest key -> (the tensor its region of the array is loaded into, that region: offsets and sizes in the array)
Destinations = dict[str, tuple[torch.Tensor, Box]]


def read_shared(shared: SharedReads, group: Group, destinations: Destinations,
                reader_of: Callable[[str], RegionReader], stored_dtype: Callable[[str], torch.dtype],
                storage: Storage, thread_count: int, failure: BaseException | None = None) -> int:
    """Run every round of ``shared`` on this rank; the bytes it read from storage. ``failure``: an error this rank
    met before (in its own reads), raised on every rank at the first round. A rank that failed reads nothing more
    and sends nothing, and every rank stops at the round's check."""
    rank = group.rank
    parts: dict[tuple, tuple[str, Box]] = {}  # unit key -> (dest, the part of it this rank receives)
    try:
        for dest in destinations:
            for key, part in shared.parts_for(rank, dest).items():
                parts[key] = (dest, part)
    except Exception as exc:  # noqa: BLE001  (raised on every rank by the first round's check)
        failure = failure or exc
    fetched = 0
    for number, units in enumerate(shared.rounds):
        sends: dict[int, list[torch.Tensor]] = defaultdict(list)
        receives: dict[int, list[torch.Tensor]] = defaultdict(list)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination view, staging buffer) to copy after
        try:
            if failure is None:
                buffers, read = _read_units(units, rank, shared, reader_of, stored_dtype, storage, thread_count)
                fetched += read
                _messages(units, rank, shared, buffers, parts, destinations, stored_dtype, group.device, sends,
                          receives, staged)
        except Exception as exc:  # noqa: BLE001  (raised on every rank by the check below)
            failure = exc
        # after every read and every message is made: a rank that cannot send what the others expect says so here
        group.check(failure, f"shared reads, round {number + 1} of {len(shared.rounds)}")
        group.exchange(sends, receives)
        for view, staging in staged:
            view.copy_(staging)
    group.check(failure, "shared reads")
    return fetched


def _read_units(units, rank: int, shared: SharedReads, reader_of, stored_dtype, storage: Storage,
                thread_count: int) -> tuple[dict[tuple, torch.Tensor], int]:
    """The units of a round this rank reads, each into a buffer of its own, concurrently; and the bytes fetched
    (checksums and shard indexes included)."""
    buffers: dict[tuple, torch.Tensor] = {}
    jobs = []
    for unit in units:
        if unit.owner != rank:
            continue
        info = shared.info[unit.key]
        array = unit.key[0]
        buffer = buffers[unit.key] = torch.empty(info.box[1], dtype=stored_dtype(array))
        jobs.append((unit.nbytes, partial(reader_of(array).read_into, list(info.box[0]), tensor_as_numpy(buffer))))
    fetched = run_jobs(jobs, storage.requests_in_flight(thread_count), storage.batch_bytes, name="dcp-zarr-read-once",
                       max_bytes_in_flight=storage.max_bytes_in_flight)
    return buffers, sum(fetched)


def _messages(units, rank: int, shared: SharedReads, buffers: dict, parts: dict, destinations: Destinations,
              stored_dtype, device: torch.device, sends: dict, receives: dict, staged: list) -> None:
    """This rank's messages of a round, in unit order: the parts it read for others (and copies its own part into
    its tensor), and where each part it receives goes. Parts smaller than PACKED_BELOW travel together, as the last
    message of each pair of ranks (a model's optimizer ``step`` scalars are one message, not one each)."""
    packed_out: dict[int, list[torch.Tensor]] = defaultdict(list)
    packed_in: dict[int, list[tuple[torch.Tensor, Box, torch.dtype]]] = defaultdict(list)
    for unit in units:
        info = shared.info[unit.key]
        dtype = stored_dtype(unit.key[0])
        if unit.owner == rank:
            buffer = buffers[unit.key]
            made: dict[Box, torch.Tensor] = {}  # one message per distinct part, however many ranks get it
            for receiver, part in shared.receivers(unit.key):
                view = buffer[_within(part, info.box)]
                if receiver == rank:
                    target, region = destinations[info.dest]
                    target[_within(part, region)].copy_(view)
                    continue
                if part not in made:
                    made[part] = as_message(view, device)
                (packed_out[receiver] if _small(part, dtype) else sends[receiver]).append(made[part])
        elif unit.key in parts:
            dest, part = parts[unit.key]
            target, region = destinations[dest]
            view = target[_within(part, region)]
            if _small(part, dtype):
                packed_in[unit.owner].append((view, part, dtype))
            elif view.is_contiguous() and view.device == device and view.dtype == dtype:
                receives[unit.owner].append(view.reshape(-1).view(torch.uint8))
            else:
                staging = torch.empty(part[1], dtype=dtype, device=device)
                staged.append((view, staging))
                receives[unit.owner].append(staging.reshape(-1).view(torch.uint8))
    for receiver, messages in packed_out.items():
        sends[receiver].append(torch.cat([padded(m) for m in messages]))
    for owner, views in packed_in.items():
        sizes = [math.prod(part[1]) * dtype.itemsize for _, part, dtype in views]
        together = torch.empty(sum(aligned(n) for n in sizes), dtype=torch.uint8, device=device)
        receives[owner].append(together)
        at = 0
        for (view, part, dtype), n in zip(views, sizes):  # each part's bytes, copied out once they are in
            staged.append((view, together[at: at + n].view(dtype).reshape(part[1])))
            at += aligned(n)


def _small(part: Box, dtype: torch.dtype) -> bool:
    return math.prod(part[1]) * dtype.itemsize < PACKED_BELOW


def _within(part: Box, box: Box) -> tuple[slice, ...]:
    """The slices of ``part`` (global coordinates) in a tensor holding ``box``."""
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(part[0], part[1], box[0]))
