"""The rounds of a load's shared reads (shared_reads.py), on every rank: each reader reads its units of the round,
then every rank sends and receives the round's parts, receiving straight into the tensors being loaded where it
can. A rank that failed to read stops every rank at the next round (transfer.py)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch

from dcp_zarr.chunk_io import RegionReader
from dcp_zarr.collective.shared_reads import SharedReads
from dcp_zarr.collective.transfer import Group, as_message
from dcp_zarr.format.dtypes import tensor_as_numpy
from dcp_zarr.local_plan.boxes import Box
from dcp_zarr.scheduler import run_jobs
from dcp_zarr.storage import Storage

# dest key -> (the tensor its region of the array is loaded into, that region: offsets and sizes in the array)
Destinations = dict[str, tuple[torch.Tensor, Box]]


def read_shared(shared: SharedReads, group: Group, destinations: Destinations,
                reader_of: Callable[[str], RegionReader], stored_dtype: Callable[[str], torch.dtype],
                storage: Storage, thread_count: int, failure: BaseException | None = None) -> int:
    """Run every round of ``shared`` on this rank; the bytes it read from storage. ``failure``: an error this rank
    met before (in its own reads), raised on every rank at the first round."""
    rank = group.rank
    parts: dict[tuple, tuple[str, Box]] = {}  # unit key -> (dest, the part of it this rank receives)
    for dest in destinations:
        for key, part in shared.parts_for(rank, dest).items():
            parts[key] = (dest, part)
    fetched = 0
    for number, units in enumerate(shared.rounds):
        buffers: dict[tuple, torch.Tensor] = {}
        try:
            jobs = []
            for unit in units:
                if unit.owner != rank:
                    continue
                info = shared.info[unit.key]
                array = unit.key[0]
                buffer = buffers[unit.key] = torch.empty(info.box[1], dtype=stored_dtype(array))
                jobs.append((unit.nbytes, partial(reader_of(array).read_into, list(info.box[0]),
                                                  tensor_as_numpy(buffer))))
            fetched += sum(run_jobs(jobs, storage.requests_in_flight(thread_count), storage.batch_bytes,
                                    name="dcp-zarr-read-once", max_bytes_in_flight=storage.max_bytes_in_flight))
        except Exception as exc:  # noqa: BLE001  (raised on every rank by the check below)
            failure = failure or exc
        group.check(failure, f"shared reads, round {number + 1} of {len(shared.rounds)}")
        sends: dict[int, list[torch.Tensor]] = defaultdict(list)
        receives: dict[int, list[torch.Tensor]] = defaultdict(list)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination view, staging buffer) to copy after
        for unit in units:
            info = shared.info[unit.key]
            if unit.owner == rank:
                buffer = buffers[unit.key]
                made: dict[Box, torch.Tensor] = {}  # one message per distinct part, however many ranks get it
                for receiver, part in shared.receivers(unit.key):
                    view = buffer[_within(part, info.box)]
                    if receiver == rank:
                        target, region = destinations[info.dest]
                        target[_within(part, region)].copy_(view)
                    else:
                        if part not in made:
                            made[part] = as_message(view, group.device)
                        sends[receiver].append(made[part])
            elif unit.key in parts:
                dest, part = parts[unit.key]
                target, region = destinations[dest]
                view = target[_within(part, region)]
                if view.is_contiguous() and view.device == group.device and view.dtype == stored_dtype(unit.key[0]):
                    receives[unit.owner].append(view.reshape(-1).view(torch.uint8) if view.numel() else view)
                else:
                    staging = torch.empty(part[1], dtype=stored_dtype(unit.key[0]), device=group.device)
                    staged.append((view, staging))
                    receives[unit.owner].append(staging.reshape(-1).view(torch.uint8))
        group.exchange(sends, receives)
        for view, staging in staged:
            view.copy_(staging)
    group.check(failure, "shared reads")
    return fetched


def _within(part: Box, box: Box) -> tuple[slice, ...]:
    """The slices of ``part`` (global coordinates) in a tensor holding ``box``."""
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(part[0], part[1], box[0]))
