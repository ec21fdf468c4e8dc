"""The writer kinds the benchmarks measure (benchmarks/README.md): ``dcp.save`` and ``dcp.load`` with each kind's
writer and reader, optionally behind a link of limited bandwidth, and raw I/O of the same bytes. Nothing here imports
dcp_zarr at import time: DCP's own writer can be measured where dcp_zarr does not import.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from benchmarks.harness import leaves, local


def parse_kind(spec: str) -> tuple[str, dict[str, Any]]:
    """``zarr-dcp:check_replicas=none:aggregate_below=0`` -> ("zarr-dcp", {"check_replicas": "none", ...}): a kind and
    the options its ZarrWriter and ZarrReader take (each passes on those it knows); an option without a value is
    True (``fs:zstd``: FileSystemWriter with DCP's ZStandard extension)."""
    kind, *options = spec.split(":")
    parsed: dict[str, Any] = {}
    for option in options:
        key, equals, value = option.partition("=")
        parsed[key] = True if not equals else int(value) if value.lstrip("-").isdigit() else {
            "True": True, "False": False}.get(value, value)
    return kind, parsed


ZARR_KINDS = ("zarr", "zarr-plain", "zarr-dcp")
_READER_ONLY = ("read_once", "read_once_below")
_READER_OPTIONS = (*_READER_ONLY, "exchange_bytes")


def throttled(path: str, storage_options: dict | None, bytes_per_second: float | None,
              zarr: bool) -> tuple[str, dict | None, Any]:
    """(path, storage_options, DCP FileSystem or None) for a kind behind this process's link of ``bytes_per_second``
    (dcp_zarr/testing/throttled.py): dcp_zarr's ``throttled://`` location, DCP's files through a FileSystem whose
    writes and reads are charged to the same link."""
    if not bytes_per_second:
        return path, storage_options, None
    from dcp_zarr.testing.throttled import link, register_throttled

    if zarr:
        register_throttled()
        return f"throttled://{path}", {**(storage_options or {}), "bytes_per_second": bytes_per_second}, None
    return path, storage_options, metered_file_system(link(bytes_per_second))


def metered_file_system(meter: Any) -> Any:
    """A DCP FileSystem whose streams' writes and reads each go through ``meter.timed(transfer, nbytes)``."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Stream:
        def __init__(self, stream):
            self._stream = stream

        def __getattr__(self, name: str):
            return getattr(self._stream, name)

        def write(self, data) -> int:
            return meter.timed(lambda: self._stream.write(data), lambda n: memoryview(data).nbytes if n is None else n)

        def read(self, size: int = -1) -> bytes:
            return meter.timed(lambda: self._stream.read(size), len)

        def readinto(self, buffer) -> int:
            return meter.timed(lambda: self._stream.readinto(buffer), lambda n: n or 0)

    class MeteredFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield Stream(stream)

    return MeteredFileSystem()


def save(spec: str, state: Any, path: str, threads: int | None = None, storage_options: dict | None = None,
         bytes_per_second: float | None = None, **writer_options) -> None:
    """``dcp.save`` with a kind's writer: ``zarr`` (ZarrWriter with ZarrSavePlanner), ``zarr-plain`` (ZarrWriter
    alone, the line users write, which takes DCP's own planner over), ``zarr-dcp`` (ZarrWriter planned by DCP's
    planning: a planner subclass keeps it), ``fs`` (FileSystemWriter, ``sync_files=True``), ``fsspec`` (FsspecWriter);
    ``raw``: ``write_raw`` into ``path``, no DCP. ``threads``: None, the default; ``bytes_per_second``: behind a link
    (``throttled``); ``writer_options``: ZarrWriter's, besides the kind's."""
    kind, options = parse_kind(spec)
    options.update(writer_options)
    path, storage_options, file_system = throttled(path, storage_options, bytes_per_second, kind in ZARR_KINDS)
    counts = {} if threads is None else {"thread_count": threads}
    planner = None
    if kind == "raw":
        os.makedirs(path, exist_ok=True)
        return write_raw(state, os.path.join(path, f"rank{dist.get_rank()}.bin"), threads or 4)
    if kind in ZARR_KINDS:
        from dcp_zarr import ZarrSavePlanner, ZarrWriter
        from dcp_zarr.testing.planners import DCPsPlanning

        options = {k: v for k, v in options.items() if k not in _READER_ONLY}
        writer: Any = ZarrWriter(path, storage_options=storage_options, **counts, **options)
        planner = {"zarr": ZarrSavePlanner(), "zarr-dcp": DCPsPlanning()}.get(kind)
    elif kind == "fs":
        writer = FileSystemWriter(path, sync_files=True, **counts, **_extensions(options))
        writer.fs = file_system or writer.fs
    elif kind == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # sync_files=False: on an object store DCP's fsync falls back to os.sync(), the whole machine's
        writer = FsspecWriter(path, sync_files=False, **counts, **_extensions(options), **(storage_options or {}))
    else:
        raise ValueError(f"unknown writer kind {spec!r}")
    dcp.save(state, storage_writer=writer, planner=planner)


def _extensions(options: dict[str, Any]) -> dict[str, Any]:
    """``zstd``: DCP's ZStandard stream extension (its readers decode it from the metadata)."""
    if not options.get("zstd"):
        return {}
    from torch.distributed.checkpoint._extension import ZStandard

    return {"_extensions": [ZStandard()]}


def load(spec: str, target: Any, path: str, threads: int | None = None, storage_options: dict | None = None,
         bytes_per_second: float | None = None) -> None:
    """``dcp.load`` into ``target`` with a kind's reader (FileSystemReader, FsspecReader: no threads), or read_raw."""
    kind, options = parse_kind(spec)
    path, storage_options, file_system = throttled(path, storage_options, bytes_per_second, kind in ZARR_KINDS)
    if kind == "raw":
        return read_raw(target, os.path.join(path, f"rank{dist.get_rank()}.bin"), threads or 4)
    if kind in ZARR_KINDS:
        from dcp_zarr import ZarrReader

        options = {k: v for k, v in options.items() if k in _READER_OPTIONS}
        reader: Any = ZarrReader(path, storage_options=storage_options,
                                 **({} if threads is None else {"thread_count": threads}), **options)
    elif kind == "fs":
        reader = FileSystemReader(path)
        reader.fs = file_system or reader.fs
    elif kind == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(path, **(storage_options or {}))
    else:
        raise ValueError(f"unknown reader kind {spec!r}")
    dcp.load(target, storage_reader=reader)


def write_raw(state: Any, path: str, threads: int = 4) -> None:
    """Raw I/O, the storage's limit: this rank's local tensor bytes (copied to host first, for CUDA tensors) written
    back to back into one file with ``os.pwrite`` from ``threads`` threads, then fsync. No format, no planning."""

    def write(fd: int, tensor: torch.Tensor, offset: int) -> None:
        data = memoryview(local(tensor).detach().reshape(-1).view(torch.uint8).cpu().numpy())  # numpy has no bf16
        while data:
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written

    _raw_io(state, path, threads, write, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)


def read_raw(target: Any, path: str, threads: int = 4) -> None:
    """Raw I/O back: ``write_raw``'s file read into ``target``'s local tensors (of the same sharding)."""

    def read(fd: int, tensor: torch.Tensor, offset: int) -> None:
        view = local(tensor).detach().reshape(-1).view(torch.uint8)
        host = view if view.device.type == "cpu" else torch.empty_like(view, device="cpu")
        buffer = memoryview(host.numpy())
        while buffer:
            got = os.preadv(fd, [buffer], offset)
            if not got:
                raise EOFError(f"{path} ends at {offset}")
            buffer, offset = buffer[got:], offset + got
        if host is not view:
            view.copy_(host)

    _raw_io(target, path, threads, read, os.O_RDONLY)


def _raw_io(state: Any, path: str, threads: int, io: Callable[[int, torch.Tensor, int], None], flags: int) -> None:
    """``io(fd, tensor, offset)`` for this rank's tensors at their offsets in one file, largest first, each to the
    thread with the fewest bytes; the file fsynced after writes."""
    buckets: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(max(1, threads))]
    loads, offset = [0] * len(buckets), 0
    for tensor in sorted(leaves(state), key=lambda t: -local(t).numel() * t.element_size()):
        size = local(tensor).numel() * tensor.element_size()
        least = loads.index(min(loads))
        buckets[least].append((tensor, offset))
        loads[least] += size
        offset += size
    fd = os.open(path, flags, 0o644)
    try:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(lambda bucket: [io(fd, tensor, at) for tensor, at in bucket], buckets))
        if flags & os.O_WRONLY:
            os.fsync(fd)
    finally:
        os.close(fd)


def remove_s3(url: str, storage_options: dict) -> None:
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **storage_options).rm(url, recursive=True)
