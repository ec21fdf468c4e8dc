"""The writer kinds being compared: ``zarr`` (dcp_zarr), ``fs`` (DCP's FileSystemWriter/Reader), ``raw`` (the limit).

``raw`` is not a checkpoint format: each rank writes its local shard bytes, back to back, into one file with
os.pwrite from ``threads`` threads, then fsyncs it. No metadata, no planning, no collectives: what the storage allows.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from ckpt_model import local_view, tensor_leaves
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

WRITER_KINDS = ("zarr", "fs", "raw")
DCP_KINDS = ("zarr", "fs")  # kinds that are real DCP storage writers/readers


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in WRITER_KINDS]
    if unknown or not kinds:
        raise ValueError(f"--kinds takes a comma-separated subset of {','.join(WRITER_KINDS)}; got {text!r}")
    return tuple(k for k in WRITER_KINDS if k in kinds)  # canonical order


def require_dcp_zarr() -> str:
    """Import dcp_zarr or stop with a message saying why; returns where it was imported from."""
    try:
        import dcp_zarr
        from dcp_zarr import ZarrReader, ZarrWriter  # noqa: F401
    except Exception as exc:  # an ImportError, or any error raised while dcp_zarr imports
        raise SystemExit(
            f"the 'zarr' kind needs `from dcp_zarr import ZarrWriter, ZarrReader`, which failed: {exc!r}\n"
            "fix dcp_zarr, or benchmark without it: --kinds fs,raw"
        ) from exc
    return os.path.dirname(os.path.abspath(dcp_zarr.__file__))


def make_writer(kind: str, path: str, threads: int, **zarr_options):
    if kind == "zarr":
        from dcp_zarr import ZarrWriter

        return ZarrWriter(path, thread_count=threads, sync_files=True, **zarr_options)
    if kind == "fs":
        return FileSystemWriter(path, thread_count=threads, sync_files=True)
    raise ValueError(f"{kind!r} is not a DCP writer kind")


def make_planner(kind: str):
    """The save planner of a writer kind: ZarrSavePlanner for zarr (planned locally, as the README saves), DCP's
    default for the others."""
    if kind == "zarr":
        from dcp_zarr import ZarrSavePlanner

        return ZarrSavePlanner()
    return None


def make_reader(kind: str, path: str, threads: int):
    if kind == "zarr":
        from dcp_zarr import ZarrReader

        return ZarrReader(path, thread_count=threads)
    if kind == "fs":
        return FileSystemReader(path)  # single-threaded by design; it has no thread_count
    raise ValueError(f"{kind!r} is not a DCP reader kind")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    # .cpu() is the device-to-host copy on CUDA (and a no-op on CPU); uint8 view because numpy has no bfloat16.
    local = local_view(tensor).detach().cpu().contiguous()
    return memoryview(local.reshape(-1).view(torch.uint8).numpy())


def write_raw_shards(state_dict: Any, path: str, threads: int) -> int:
    """Write this rank's local tensor bytes into ``path`` with ``threads`` threads, fsync; returns bytes written."""
    tensors = sorted(tensor_leaves(state_dict), key=lambda t: -local_view(t).numel() * t.element_size())
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += local_view(tensor).numel() * tensor.element_size()
    # Largest first, each to the least-loaded thread: threads get similar shares of bytes.
    buckets: list[list[int]] = [[] for _ in range(max(1, threads))]
    loads = [0] * len(buckets)
    for i, tensor in enumerate(tensors):
        least = loads.index(min(loads))
        buckets[least].append(i)
        loads[least] += local_view(tensor).numel() * tensor.element_size()

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def write_bucket(indices: list[int]) -> None:
            for i in indices:
                _pwrite_all(fd, _host_bytes(tensors[i]), offsets[i])

        with ThreadPoolExecutor(max_workers=len(buckets), thread_name_prefix="raw-writer") as pool:
            list(pool.map(write_bucket, buckets))
        os.fsync(fd)
    finally:
        os.close(fd)
    return total
