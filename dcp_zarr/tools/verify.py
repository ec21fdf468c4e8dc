"""``dcp-zarr verify``: is the checkpoint complete, is every chunk present, and does every chunk match its crc32c?

Each chunk (each inner chunk of a sharded array) is read once and checked on its own, so a report names every bad
chunk, not just the first. Reads are concurrent (many small GETs on an object store) and bounded in memory: a
shard is read one inner chunk at a time, never whole. Nothing here needs torch: chunks are checked as bytes, and
``torch.save`` values are checked by their crc32c, never unpickled.

An inner chunk stored as it is must have exactly its full size. A compressed one (``ChunkLayout.codec``) has the
length its shard's index gives, which must be more than a crc32c and at most ``inner_chunk_stored_bytes`` (the most
its codec makes of data that does not compress); a longer one is refused unread, as an index may point anywhere. Then
its crc32c is checked and it is decompressed, which must give exactly the inner chunk's bytes
(``encoding.verify_stored``).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dcp_zarr.errors import CorruptChunkError, MalformedMetadataError
from dcp_zarr.format.chunk_layout import ChunkLayout, parent_groups
from dcp_zarr.format.encoding import (
    CHECKSUM_BYTES,
    MISSING,
    decode_shard_index,
    inner_chunk_stored_bytes,
    shard_index_bytes,
    verify_plain,
    verify_stored,
)
from dcp_zarr.format.manifest import OBJECT, TENSOR, ObjectEntry
from dcp_zarr.offline import Checkpoint, Entry
from dcp_zarr.progress import progress_bar
from dcp_zarr.store_io.entry_data import array_document, tensor_reader


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the store: which entry, which array and chunk, and what."""

    fqn: str
    node: str
    chunk: str | None  # "c.0.0", "c.1.0 inner chunk 3" ("c/0/0" in format 1 and 2), or None for the node's metadata
    message: str
    node_type: str = "array"

    def __str__(self) -> str:
        where = f"{self.node_type} {self.node!r}" + (f" chunk {self.chunk}" if self.chunk else "")
        return f"{where} (entry {self.fqn!r}): {self.message}"


@dataclass
class VerifyReport:
    url: str
    entries: int = 0
    chunks: int = 0
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class _ChunkJob:
    entry: Entry
    layout: ChunkLayout
    coords: tuple[int, ...]
    itemsize: int


def verify_checkpoint(ckpt: Checkpoint, *, thread_count: int = 8, progress: bool | None = False) -> VerifyReport:
    """Check every stored byte of ``ckpt``; problems are collected, not raised."""
    report = VerifyReport(url=ckpt.url, entries=len(ckpt))
    jobs: list[_ChunkJob] = []
    groups: dict[str, str] = {}
    for entry in ckpt:
        for group in parent_groups(entry.node):
            groups.setdefault(group, entry.fqn)
        if entry.kind == TENSOR:
            jobs.extend(_tensor_jobs(ckpt, entry, report))
        elif entry.kind == OBJECT:
            _check_object(ckpt, entry, report)
    for group, fqn in groups.items():
        if not ckpt.storage.exists(f"{group}/zarr.json"):
            report.problems.append(
                Problem(fqn, group, None, "zarr.json is missing (zarr tools cannot open it)", "group"))

    total = sum(_chunk_bytes(job) for job in jobs)
    with progress_bar(total, "verifying", enabled=progress) as bar, ThreadPoolExecutor(thread_count) as pool:
        for job, (found, nbytes) in zip(jobs, pool.map(lambda job: _check_chunk(ckpt, job), jobs)):
            report.problems.extend(found)
            report.bytes_read += nbytes
            report.chunks += 1
            bar.update(_chunk_bytes(job))  # the total's measure: what is read of a compressed chunk is less
    return report


def _tensor_jobs(ckpt: Checkpoint, entry: Entry, report: VerifyReport) -> list[_ChunkJob]:
    try:  # the same checks of the array's own zarr.json against the manifest as a load makes with its copy
        own = array_document(ckpt.storage, entry.node, entry.fqn)
        layout = tensor_reader(ckpt.storage, ckpt.manifest.entries[entry.fqn], entry.fqn, own).layout
    except (CorruptChunkError, MalformedMetadataError) as exc:
        report.problems.append(Problem(entry.fqn, entry.node, None, str(exc)))
        return []
    copy = ckpt.manifest.node_documents.get(entry.node)
    if copy is not None and copy != own:
        report.problems.append(Problem(entry.fqn, entry.node, None, "zarr.json differs from its copy in the root "
                                       "zarr.json (which dcp_zarr reads)"))
    if entry.fill is not None:  # kept in the zarr.json's fill_value, checked above: no chunk is stored
        return []
    itemsize = _itemsize(entry)
    return [_ChunkJob(entry, layout, c, itemsize) for c in layout.all_chunks()]


def _check_chunk(ckpt: Checkpoint, job: _ChunkJob) -> tuple[list[Problem], int]:
    entry, layout = job.entry, job.layout
    key = layout.chunk_key(job.coords)
    path = f"{entry.node}/{key}"
    plain_bytes = math.prod(layout.inner_chunk_shape) * job.itemsize + CHECKSUM_BYTES
    try:
        if not layout.sharded:
            raw = _read_expected(ckpt, path, plain_bytes)
            _check_plain(raw, plain_bytes)
            return [], len(raw)
        return _check_shard(ckpt, job, path, plain_bytes)
    except FileNotFoundError:
        return [Problem(entry.fqn, entry.node, key, "chunk is missing from the store")], 0
    except CorruptChunkError as exc:
        return [Problem(entry.fqn, entry.node, key, _reason(exc))], 0


def _check_shard(ckpt: Checkpoint, job: _ChunkJob, path: str, inner_bytes: int) -> tuple[list[Problem], int]:
    entry, layout = job.entry, job.layout
    key = layout.chunk_key(job.coords)
    index = decode_shard_index(ckpt.storage.read_tail(path, shard_index_bytes(layout)), layout, "shard")
    _, extent = layout.chunk_box(job.coords)
    most = inner_chunk_stored_bytes(layout, job.itemsize)  # inner_bytes, or for a compressed one the most it can be
    problems, nbytes = [], shard_index_bytes(layout)
    for i, (offset, length) in enumerate(index):
        where = f"{key} inner chunk {i}"
        if offset == MISSING:
            if i * layout.inner_rows < extent[0]:  # only inner chunks wholly in the edge padding may be absent
                problems.append(Problem(entry.fqn, entry.node, where, "the shard index marks it missing"))
            continue
        # refused unread: a hostile index may point at gigabytes
        if layout.codec is None and int(length) != inner_bytes:
            problems.append(Problem(entry.fqn, entry.node, where, f"the shard index gives it {int(length)} bytes, "
                                    f"an inner chunk holds {inner_bytes}"))
            continue
        if layout.codec is not None and not CHECKSUM_BYTES < int(length) <= most:
            problems.append(Problem(entry.fqn, entry.node, where, f"the shard index gives it {int(length)} bytes, "
                                    f"a compressed inner chunk holds {CHECKSUM_BYTES + 1} to {most}"))
            continue
        raw = ckpt.storage.read_range(path, int(offset), int(length))
        nbytes += len(raw)
        try:
            if len(raw) != int(length):
                raise CorruptChunkError(
                    f"shard is truncated ({len(raw)} of {int(length)} bytes at offset {int(offset)})")
            if layout.codec is None:
                _check_plain(raw, inner_bytes)
            else:
                verify_stored(raw, layout, job.itemsize, "")
        except CorruptChunkError as exc:
            problems.append(Problem(entry.fqn, entry.node, where, _reason(exc)))
    return problems, nbytes


def _read_expected(ckpt: Checkpoint, path: str, expected_bytes: int) -> bytes:
    """At most what the metadata allows: a chunk file grown to gigabytes is refused after ``expected_bytes`` + 1."""
    raw = ckpt.storage.read_range(path, 0, expected_bytes + 1)
    if len(raw) > expected_bytes:
        raise CorruptChunkError(f"chunk holds more than the {expected_bytes} bytes its metadata allows")
    return raw


def _check_plain(raw, expected_bytes: int) -> None:
    verify_plain(raw, "")
    if len(raw) != expected_bytes:
        raise CorruptChunkError(f"chunk holds {len(raw)} bytes, expected {expected_bytes}")


def _check_object(ckpt: Checkpoint, entry: Entry, report: VerifyReport) -> None:
    stored = ckpt.manifest.entries[entry.fqn]
    assert isinstance(stored, ObjectEntry)  # called for object entries only
    chunk = stored.chunk  # "c.0", or "c/0" in format 1 and 2
    try:
        raw = _read_expected(ckpt, f"{entry.node}/{chunk}", entry.nbytes + CHECKSUM_BYTES)
        _check_plain(raw, entry.nbytes + CHECKSUM_BYTES)
        report.bytes_read += len(raw)
    except FileNotFoundError:
        report.problems.append(Problem(entry.fqn, entry.node, chunk, "chunk is missing from the store"))
    except CorruptChunkError as exc:
        report.problems.append(Problem(entry.fqn, entry.node, chunk, _reason(exc)))
    report.chunks += 1


def _reason(exc: CorruptChunkError) -> str:
    return str(exc).removeprefix(": ")  # verify_plain's messages start with the (empty) location we passed


def _itemsize(entry: Entry) -> int:
    dtype = entry.numpy_dtype
    assert dtype is not None  # a tensor entry's
    return dtype.itemsize


def _chunk_bytes(job: _ChunkJob) -> int:
    """The chunk's bytes uncompressed (without checksums and index): the progress bar's measure."""
    return math.prod(job.layout.chunk_shape) * job.itemsize
