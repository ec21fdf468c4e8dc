"""The jobs that write one rank's part of a save, built entry by entry: how an entry is stored follows from its kind
and where its data is.

- a value plain JSON holds exactly: no job, the manifest carries it (``value``);
- any other value: its ``torch.save`` bytes, one uint8 array (``value``);
- a tensor's box in an array-spanning shard, on a backend that writes parts of a file: runs of inner chunks at their
  offsets (``tensor``);
- a host tensor's box: one job per chunk, of views of the tensor (``tensor``);
- a device tensor's box: one job per chunk, each copying its region to host memory on the IO thread that writes it
  (``tensor``).

Every array's zarr.json is a job too (``array_metadata``). ``run`` runs them all on the storage's IO threads. How a
chunk's bytes are encoded is decided here, per entry, so this is where a codec choice belongs.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable, Sequence
from functools import partial

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch

from dcp_zarr.errors import UntrustedTypeWarning
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.chunk_layout import ChunkLayout, chunk_key
from dcp_zarr.format.encoding import array_metadata, checksum
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.format.values import NotJSONError, encode_value
from dcp_zarr.json_documents import json_text
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.chunk_reuse import ChunkReuse, ReuseCounts
from dcp_zarr.store_io.chunks import (
    chunk_regions,
    chunks_of_box,
    inner_chunk_runs,
    numbered_chunk_regions,
    stored_nbytes,
    write_chunk,
    write_inner_chunks,
)
from dcp_zarr.store_io.entry_data import untrusted_types
from dcp_zarr.store_io.scheduler import run_jobs

# A rank's rows of an array-spanning shard are written in runs of about this many bytes: one job each, so a large
# box is spread over the IO threads (and a device tensor is copied to host a run at a time).
SHARD_RUN_BYTES = 16 << 20
OBJECT_CONTENT = "torch.save bytes (load with weights_only=True)"
NOT_LOOKED_UP = object()  # a value whose planner cannot look it up (no lookup_object): stored as its bytes

Job = tuple[int, Callable[[], object]]  # (bytes it moves, the call: a chunk's returns the bytes it stored)


class WriteJobs:
    """One rank's writes into ``storage``, and the chunk keys they write (``"node/c.0.0"``, or ``"node/c.0.0#3"``
    per inner chunk of an array-spanning shard), which lets tests prove that no chunk is written by two ranks.
    ``reuse``: in a save that records its chunks (incremental), each chunk goes through it, linked from the earlier
    checkpoint where it can be."""

    def __init__(self, storage: Storage, reuse: ChunkReuse | None = None):
        self.storage = storage
        self.reuse = reuse
        self.jobs: list[Job] = []
        self.chunk_keys: list[str] = []
        self._devices: set[torch.device] = set()  # of tensors copied to host on the IO threads
        self._objects = 0  # the chunk objects the jobs write themselves (a shard ranks fill: the rank with its index)
        self._stored_bytes = 0  # what they stored, once run

    def stored(self) -> ReuseCounts:
        """The chunk objects these jobs stored once run, and their bytes: linked from the earlier checkpoint (through
        ``reuse``) and written. A shard that ranks fill at offsets counts once, for the rank that writes its index."""
        reused = self.reuse.counts() if self.reuse is not None else ReuseCounts(0, 0, 0, 0)
        return reused._replace(written_chunks=reused.written_chunks + self._objects,
                               written_bytes=reused.written_bytes + self._stored_bytes)

    def array_metadata(self, spec: ArraySpec, fill=None) -> None:
        """The array's zarr.json; ``fill``: the value of an array kept in its fill_value, with no chunk."""
        self.jobs.append((0, partial(_write_array_metadata, self.storage, spec, fill)))

    def value(self, fqn: str, node: str, value, saved_bytes: Callable[[], bytes]) -> tuple[dict, int]:
        """A non-tensor entry: its JSON document if plain JSON holds ``value`` exactly, else its ``torch.save``
        bytes (``saved_bytes()``, the planner's) written as an array. The entry's storage data for the manifest
        (``{"value": document}`` or ``{"object_nbytes": n}``), and its size. ``value``: ``NOT_LOOKED_UP`` where it is
        not known."""
        if value is not NOT_LOOKED_UP:
            try:
                document = encode_value(value)
                return {"value": document}, len(json.dumps(document))
            except NotJSONError:
                pass
        data = saved_bytes()
        untrusted = untrusted_types(data)
        if untrusted:  # it saves, but would fail at load without options: say so at save, while the run can change it
            kind = "" if value is NOT_LOOKED_UP else f" ({type(value).__module__}.{type(value).__qualname__})"
            warnings.warn(UntrustedTypeWarning(
                f"state-dict value {fqn!r}{kind} is stored as torch.save bytes holding types that "
                f"torch.load(weights_only=True) does not trust: {', '.join(untrusted)}. Loading it will need "
                "ZarrReader(..., safe_globals=[...]) or open_checkpoint(..., safe_globals=[...]) naming them"),
                stacklevel=2)
        key = f"{node}/{chunk_key((0,))}"
        self.chunk_keys.append(key)
        self._objects += 1
        self.jobs.append((len(data), partial(_write, self.storage, key, [data, checksum(data)])))
        self.jobs.append((0, partial(self.storage.write_json, f"{node}/zarr.json",
                                     object_array_metadata(fqn, node, len(data)))))
        return {"object_nbytes": len(data)}, len(data)

    def tensor(self, spec: ArraySpec, tensor: torch.Tensor, offsets: Sequence[int]) -> None:
        """The chunks of ``tensor``, this rank's box of the array at ``offsets`` (whole chunks of its grid)."""
        layout = spec.layout
        on_host = _on_host(tensor)
        if not on_host:
            self._devices.add(tensor.device)
        if self.reuse is not None:
            self._recorded_chunks(spec, tensor, offsets, on_host)
        elif layout.fixed_offsets and self.storage.writes_at_offsets:
            self._shard_runs(spec, tensor, offsets[0], on_host)
        elif on_host:
            for chunk, data in chunks_of_box(layout, offsets, tensor_as_numpy(tensor)):
                key = f"{spec.node}/{chunk}"
                self.chunk_keys.append(key)
                self._objects += 1
                self.jobs.append((data.nbytes, partial(write_chunk, self.storage, key, data, layout)))
        else:
            # Each chunk of a device tensor is copied to host memory on an IO thread just before it is written:
            # copies overlap other chunks' writes, and at most thread_count chunks are in host memory at once
            # (copying every tensor first would hold a host copy of the whole state dict).
            for chunk, region in chunk_regions(layout, offsets, tensor.shape):
                key = f"{spec.node}/{chunk}"
                self.chunk_keys.append(key)
                self._objects += 1
                nbytes = math.prod(s.stop - s.start for s in region) * tensor.element_size()
                self.jobs.append((nbytes, partial(_write_from_device, self.storage, key, tensor, region, layout)))

    def _recorded_chunks(self, spec: ArraySpec, tensor: torch.Tensor, offsets: Sequence[int], on_host: bool) -> None:
        """One job per chunk, through the save's ``ChunkReuse`` (an incremental save's layouts have one object per
        chunk: planning/write_plan.py); a device tensor's chunk is copied to host on the IO thread, as below."""
        reuse, layout = self.reuse, spec.layout
        # no shard that several ranks fill at offsets in a save that records (planning/assignments.py): each chunk here
        # is one rank's whole object, encoded at once
        assert reuse is not None
        earlier = reuse.earlier_array(spec.node, encoded_array_metadata(spec))
        host = tensor_as_numpy(tensor) if on_host else None
        for index, chunk, region in numbered_chunk_regions(layout, offsets, tensor.shape):
            key = f"{spec.node}/{chunk}"
            self.chunk_keys.append(key)
            nbytes = math.prod(s.stop - s.start for s in region) * tensor.element_size()
            data = host[region] if host is not None else None
            self.jobs.append((nbytes, partial(_store_recorded, reuse, self.storage, spec.node, index, key, data,
                                              tensor, region, layout, earlier)))

    def _shard_runs(self, spec: ArraySpec, tensor: torch.Tensor, first_row: int, on_host: bool) -> None:
        """Runs of this rank's inner chunks of an array-spanning shard, at their offsets; the index goes with the
        shard's last inner chunk (it follows that chunk in the file)."""
        layout = spec.layout
        key = f"{spec.node}/{layout.chunk_key((0,) * len(layout.shape))}"
        host = tensor_as_numpy(tensor) if on_host else None
        row_bytes = math.prod(layout.shape[1:]) * spec.itemsize
        held_rows = tensor.shape[0] if tensor.numel() else 0  # an empty shard ((11, 5, 0) of an (11, 5, 1)) holds none
        for first, rows in inner_chunk_runs(layout, first_row, held_rows, spec.itemsize, SHARD_RUN_BYTES):
            count = -(-(rows.stop - rows.start) // layout.inner_rows)
            self.chunk_keys.extend(f"{key}#{i}" for i in range(first, first + count))
            with_index = first + count == layout.inner_chunks_per_chunk
            if with_index:
                self.chunk_keys.append(f"{key}#index")
                self._objects += 1
            job = (partial(write_inner_chunks, self.storage, key, host[rows], first, layout, with_index)
                   if host is not None
                   else partial(_write_rows_from_device, self.storage, key, tensor, rows, first, layout, with_index))
            self.jobs.append(((rows.stop - rows.start) * row_bytes, job))

    def run(self, thread_count: int) -> None:
        """Every job, on the storage's IO threads; durable before this returns (the coordinator may commit next)."""
        _wait_for_current_streams(self._devices)
        storage = self.storage
        stored = run_jobs(self.jobs, storage.requests_in_flight(thread_count), storage.batch_bytes,
                          name="dcp-zarr-write", max_bytes_in_flight=storage.max_bytes_in_flight)
        storage.flush()
        self._stored_bytes = sum(n for n in stored if isinstance(n, int))


def object_array_metadata(fqn: str, node: str, nbytes: int) -> dict:
    """The zarr.json of a value stored as ``torch.save`` bytes: a uint8 array of one chunk."""
    return array_metadata(ChunkLayout((nbytes,), (max(nbytes, 1),)), "uint8", 1,
                          {"dcp_zarr": {"fqn": fqn, "content": OBJECT_CONTENT}}, node=node)


@functools.lru_cache(maxsize=1 << 14)
def encoded_array_metadata(spec: ArraySpec) -> str:
    """The array's zarr.json, encoded, as written to its node and copied into the manifest's nodes: a
    function of the spec alone, made once a process for each array of a model saved again and again (the
    coordinator's ``finish``, which every rank's save waits for, copies every array's)."""
    return _encoded(spec, None)


def array_metadata_text(spec: ArraySpec, fill=None) -> str:
    """The array's zarr.json, encoded; ``fill``: the value of an array kept in its fill_value (format/fill_values.py),
    whose document is not cached: the value changes from save to save, and 0.0, -0.0 and False would share one cache
    entry."""
    return encoded_array_metadata(spec) if fill is None else _encoded(spec, fill)


def _encoded(spec: ArraySpec, fill) -> str:
    return json_text(array_metadata(spec.layout, spec.data_type, spec.itemsize,
                                    {"dcp_zarr": {"fqn": spec.fqn, "dtype": spec.dtype_name}}, node=spec.node,
                                    fill_value=fill))


def _write_array_metadata(storage: Storage, spec: ArraySpec, fill) -> None:
    # The document is made on the IO thread, just before it is written, not with the job: hundreds of them alive at
    # once (twenty dicts and lists each) would set off the garbage collector's full collections (node_copies.py).
    storage.write(f"{spec.node}/zarr.json", [array_metadata_text(spec, fill).encode()])


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _write(storage: Storage, key: str, buffers: list) -> int:
    storage.write(key, buffers)
    return stored_nbytes(buffers)


def _write_rows_from_device(storage: Storage, key: str, tensor: torch.Tensor, rows: slice, first: int,
                            layout: ChunkLayout, with_index: bool) -> int:
    return write_inner_chunks(storage, key, tensor_as_numpy(tensor[rows].to("cpu")), first, layout, with_index)


def _write_from_device(storage: Storage, key: str, tensor: torch.Tensor, region: tuple[slice, ...],
                       layout: ChunkLayout) -> int:
    return write_chunk(storage, key, tensor_as_numpy(tensor[region].to("cpu")), layout)


def _store_recorded(reuse: ChunkReuse, storage: Storage, node: str, index: int, key: str, data, tensor: torch.Tensor,
                    region: tuple[slice, ...], layout: ChunkLayout, earlier) -> None:
    if data is None:  # a device tensor's chunk, copied to host here, on the IO thread
        data = tensor_as_numpy(tensor[region].to("cpu"))
    reuse.store(storage, node, index, key, data, layout, earlier)


def _wait_for_current_streams(devices: set[torch.device]) -> None:
    """The IO threads copy on their own streams, which do not wait for the caller's: wait here for the work queued on
    the caller's current stream (what produced the tensors) before any copy starts."""
    for device in devices:
        if device.type != "cpu":
            torch.get_device_module(device.type).current_stream(device).synchronize()
