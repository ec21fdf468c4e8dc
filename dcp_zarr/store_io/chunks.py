"""Moving array data between tensors and stored chunks: which keys a shard writes, and reading any region back."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import NamedTuple

import numpy as np

from dcp_zarr.errors import CorruptChunkError
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.encoding import (
    CHECKSUM_BYTES,
    MISSING,
    as_bytes,
    checksum,
    decode_shard_index,
    encode_chunk,
    encode_inner_chunks,
    full_shard_index,
    inner_chunk_stored_bytes,
    shard_index_bytes,
    verify_plain,
)
from dcp_zarr.format.fill_values import filled
from dcp_zarr.storage import Storage
from dcp_zarr.storage.base import StoredValue

# A large region is read as concurrent row pieces of about this size (whole chunk rows each), by ZarrReader and the
# offline API alike: enough pieces to keep several requests in flight, large enough that scheduling them costs little
# beside the reads.
READ_PIECE_BYTES = 4 << 20


def chunk_regions(layout: ChunkLayout, box_offsets: Sequence[int], sizes: Sequence[int]
                  ) -> Iterator[tuple[str, tuple[slice, ...]]]:
    """``(chunk key, region)`` for every chunk of the box (a rank's shard of ``sizes`` at ``box_offsets``); the region
    indexes the shard.

    The box must be a union of whole chunks (``chunk_layout_for_boxes`` guarantees it).
    """
    for _, key, region in numbered_chunk_regions(layout, box_offsets, sizes):
        yield key, region


def numbered_chunk_regions(layout: ChunkLayout, box_offsets: Sequence[int], sizes: Sequence[int]
                           ) -> Iterator[tuple[int, str, tuple[slice, ...]]]:
    """``chunk_regions``, each with the chunk's index in the grid's C order (the chunk record's order)."""
    grid = layout.grid_shape
    for coords in layout.chunks_in_box(box_offsets, sizes):
        offsets, extent = layout.chunk_box(coords)
        start = [o - b for o, b in zip(offsets, box_offsets)]
        if any(s < 0 or s + e > n for s, e, n in zip(start, extent, sizes)):
            raise AssertionError(f"chunk {coords} is not inside the saved box at {tuple(box_offsets)}")
        index = 0
        for c, n in zip(coords, grid):
            index = index * n + c
        yield index, layout.chunk_key(coords), tuple(slice(s, s + e) for s, e in zip(start, extent))


def chunks_of_box(
    layout: ChunkLayout, box_offsets: Sequence[int], local: np.ndarray
) -> Iterator[tuple[str, np.ndarray]]:
    """``(chunk key, data)`` for every chunk of the box that ``local`` (a rank's shard at ``box_offsets``) covers;
    each ``data`` is a view of ``local`` (unpadded), ready for ``encode_chunk``."""
    for key, region in chunk_regions(layout, box_offsets, local.shape):
        yield key, local[region]


def write_chunk(storage: Storage, key: str, data: np.ndarray, layout: ChunkLayout) -> int:
    """Encode (checksums: the CPU part) and store one chunk; run on IO threads so encoding overlaps other writes.
    Returns the bytes stored."""
    buffers = encode_chunk(data, layout)
    storage.write(key, buffers)
    return stored_nbytes(buffers)


def stored_nbytes(buffers: Sequence) -> int:
    """The bytes a write of ``buffers`` stores."""
    return sum(memoryview(b).nbytes for b in buffers)


def inner_chunk_runs(layout: ChunkLayout, first_row: int, rows: int, itemsize: int, run_bytes: int
                     ) -> Iterator[tuple[int, slice]]:
    """``(first inner chunk, rows of the box)`` for runs of whole inner chunks of about ``run_bytes`` covering a
    box of ``rows`` rows from ``first_row`` of an array-spanning shard (``ChunkLayout.spans_array``); each run is
    one write at its first inner chunk's offset, so a large box is several jobs, not one."""
    inner = layout.inner_rows
    if rows == 0:
        return
    if first_row % inner:
        raise AssertionError(f"a box starting at row {first_row} is not whole inner chunks of {inner} rows")
    row_bytes = math.prod(layout.shape[1:]) * itemsize
    step = max(1, run_bytes // max(inner * row_bytes, 1)) * inner
    for start in range(0, rows, step):
        yield (first_row + start) // inner, slice(start, min(rows, start + step))


def write_inner_chunks(storage: Storage, key: str, data: np.ndarray, first_inner: int, layout: ChunkLayout,
                       with_index: bool = False) -> int:
    """Encode whole inner chunks of an array-spanning shard and write them where they lie in its file; with
    ``with_index`` (the run holding the shard's last inner chunk) the shard's index too, which comes right after
    that chunk: one write, not a second open and write of the file. Returns the bytes stored."""
    buffers = encode_inner_chunks(data, layout)  # uncompressed only (ChunkLayout.fixed_offsets)
    if with_index:
        buffers += full_shard_index(layout, data.itemsize)
    storage.write_at(key, first_inner * inner_chunk_stored_bytes(layout, data.itemsize), buffers)
    return stored_nbytes(buffers)


class _Piece(NamedTuple):
    """One stored piece to read: a chunk, or an inner chunk of a shard (``length`` from the shard's index)."""

    offset: int
    length: int | None
    shape: tuple[int, ...]
    inside: tuple[slice, ...]  # the part of the piece wanted
    target: np.ndarray  # where that part goes
    # Which piece, for errors only (formatted by RegionReader._where when one is raised, never otherwise):
    chunk: tuple[int, ...]  # the grid coordinates of the chunk, or of the shard holding the inner chunk
    inner: int | None  # the inner chunk's index in that shard; None for a chunk, or a shard as a whole


def _fills_target(piece: _Piece) -> bool:
    """Whether the piece is wanted whole and its target is C-contiguous: then it is read (or decompressed) straight
    into the target's memory, not into a scratch buffer first."""
    return (all(s.start == 0 and s.stop == n for s, n in zip(piece.inside, piece.shape))
            and piece.target.flags.c_contiguous)


class RegionReader:
    """Reads regions of one stored array into numpy views, verifying every chunk it touches.

    Shard indexes are cached, so reading many regions of one shard fetches its index once. Thread-safe. ``fill``:
    the array's one element, kept in its fill_value with no chunk (format/fill_values.py), which every read gives.
    """

    def __init__(self, storage: Storage, node: str, layout: ChunkLayout, dtype: np.dtype, fill=None):
        self.storage = storage
        self.node = node
        self.layout = layout
        self.dtype = dtype
        self.fill = None if fill is None else filled(fill, dtype)
        self._indexes: dict[tuple[int, ...], np.ndarray] = {}
        self._lock = threading.Lock()
        # A shard spanning the array (what this library writes) is the array's one chunk: regions inside it are
        # read without walking the chunk grid (a load reads one region of each of hundreds of arrays).
        self._spanning_key = f"{node}/{layout.chunk_key((0,) * len(layout.shape))}" if layout.spans_array else None
        self._index_bytes = shard_index_bytes(layout) if layout.sharded else 0

    def read_into(self, offsets: Sequence[int], out: np.ndarray) -> int:
        """Fill ``out`` with the region of the array starting at ``offsets``; returns the bytes fetched."""
        layout = self.layout
        if self.fill is not None:
            out[...] = self.fill
            return 0
        if out.ndim == 0:
            return self._read_piece(f"{self.node}/c", 0, None, (), (), out, ())
        if out.size == 0:
            return 0  # a region without elements touches no chunk (so is never read, even from a missing file)
        if self._spanning_key is not None and all(0 <= o and o + n <= s
                                                  for o, n, s in zip(offsets, out.shape, layout.shape)):
            inside = tuple(slice(o, o + n) for o, n in zip(offsets, out.shape))
            return self._read_from_shard(self._spanning_key, (0,) * out.ndim, inside, out)
        fetched = 0
        for coords in layout.chunks_in_box(offsets, out.shape):
            chunk_offsets, chunk_extent = layout.chunk_box(coords)
            lo = [max(o, c) for o, c in zip(offsets, chunk_offsets)]
            hi = [min(o + n, c + e) for o, n, c, e in zip(offsets, out.shape, chunk_offsets, chunk_extent)]
            target = out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
            inside = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk_offsets))
            key = f"{self.node}/{layout.chunk_key(coords)}"
            if layout.sharded:
                fetched += self._read_from_shard(key, coords, inside, target)
            else:
                fetched += self._read_piece(key, 0, None, layout.chunk_shape, inside, target, coords)
        return fetched

    def row_pieces(self, offsets: Sequence[int], shape: Sequence[int], target_bytes: int) -> list[tuple[int, int]]:
        """Split a region along dim 0 into row ranges (relative to the region) of about ``target_bytes`` each, cut
        only at the array's chunk (or inner-chunk) row boundaries, so no stored piece is read by two of them.
        Reading the ranges concurrently keeps a large region from being one job on one thread."""
        rows = shape[0] if shape else 0
        if rows == 0:
            return [(0, rows)]
        step = self.layout.inner_rows if self.layout.sharded else self.layout.chunk_shape[0]
        row_bytes = math.prod(shape[1:]) * self.dtype.itemsize
        span = max(1, target_bytes // max(step * row_bytes, 1)) * step  # whole chunk rows per piece
        first, last = offsets[0], offsets[0] + rows
        return [(max(first, b) - first, min(last, b + span) - first) for b in range(first - first % span, last, span)]

    def read_jobs(self, offsets: Sequence[int], out: np.ndarray, piece_bytes: int = READ_PIECE_BYTES
                  ) -> list[tuple[int, Callable[[], int]]]:
        """``(bytes, job)`` pairs for ``scheduler.run_jobs`` that together fill ``out`` with the region at
        ``offsets``: one per row piece (``row_pieces``), each returning the bytes it fetched. None for a region
        without elements; one for a 0-d array."""
        if out.ndim == 0:
            return [(out.nbytes, partial(self.read_into, list(offsets), out))]
        if out.size == 0:
            return []
        row_bytes = out[:1].nbytes
        first, rest = offsets[0], list(offsets[1:])
        return [((hi - lo) * row_bytes, partial(self.read_into, [first + lo, *rest], out[lo:hi]))
                for lo, hi in self.row_pieces(offsets, out.shape, piece_bytes)]

    def _read_piece(self, key: str, offset: int, length: int | None, shape: tuple[int, ...],
                    inside: tuple[slice, ...], target: np.ndarray, coords: tuple[int, ...]) -> int:
        """Read one stored chunk, verify it, copy ``inside`` to ``target``."""
        piece = _Piece(offset, length, shape, inside, target, coords, None)
        with self._open(key, coords) as value:
            return self._read_run(value, [piece])

    def _open(self, key: str, coords: tuple[int, ...]) -> StoredValue:
        try:
            return self.storage.open_value(key)
        except FileNotFoundError as exc:
            raise CorruptChunkError(f"{self._name(coords)}: missing from the store") from exc

    def _read_run(self, value: StoredValue, pieces: list[_Piece]) -> int:
        """Read pieces that lie back to back in one stored file (consecutive inner chunks of a shard) with one
        request, verify each, and copy each one's ``inside`` to its ``target``: on an object store every request is
        a round trip, so a region over 4 inner chunks is 1 ranged GET, not 4.

        A piece that is exactly its ``target`` (whole, C-contiguous) is read straight into the target's memory;
        others into a scratch buffer first.
        """
        if self.layout.codec is not None:
            return self._read_compressed_run(value, pieces)
        buffers: list[memoryview] = []
        scratch: list[tuple[np.ndarray, memoryview, bytearray, bool]] = []
        for piece in pieces:
            payload_bytes = math.prod(piece.shape) * self.dtype.itemsize
            if piece.length is not None and piece.length != payload_bytes + CHECKSUM_BYTES:
                raise CorruptChunkError(f"{self._where(piece)}: stored length {piece.length} does not fit shape "
                                        f"{piece.shape}")
            whole = _fills_target(piece)
            payload = piece.target if whole else np.empty(piece.shape, dtype=self.dtype)
            stored_crc = bytearray(CHECKSUM_BYTES)
            payload_view = as_bytes(payload)
            buffers += [payload_view, memoryview(stored_crc)]
            scratch.append((payload, payload_view, stored_crc, whole))
        try:
            got = value.read_range_into(pieces[0].offset, buffers)
        except FileNotFoundError as exc:
            raise CorruptChunkError(f"{self._where(pieces[0])}: missing from the store") from exc
        for piece, (payload, payload_view, stored_crc, whole) in zip(pieces, scratch):
            expected = payload.nbytes + CHECKSUM_BYTES
            if got < expected:
                raise CorruptChunkError(f"{self._where(piece)}: truncated ({max(got, 0)} of {expected} bytes)")
            got -= expected
            if checksum(payload_view) != stored_crc:
                raise CorruptChunkError(f"{self._where(piece)}: crc32c mismatch (the chunk is corrupt)")
            if not whole:
                piece.target[...] = payload[piece.inside]
        return sum(len(b) for b in buffers)

    def _read_compressed_run(self, value: StoredValue, pieces: list[_Piece]) -> int:
        """``_read_run`` for compressed inner chunks: the run's stored bytes in one request, then each piece's
        crc32c checked and its data decompressed, straight into its target where it is the whole piece."""
        codec = self.layout.codec
        assert codec is not None
        most = inner_chunk_stored_bytes(self.layout, self.dtype.itemsize)  # the codec's most on what does not compress
        for piece in pieces:
            if piece.length is None or not CHECKSUM_BYTES < piece.length <= most:  # before reading: a hostile index
                raise CorruptChunkError(f"{self._where(piece)}: stored length {piece.length} is not that of a "
                                        f"compressed chunk of shape {piece.shape} (at most {most} bytes)")
        stored = bytearray(sum(p.length for p in pieces if p.length is not None))
        try:
            got = value.read_range_into(pieces[0].offset, [memoryview(stored)])
        except FileNotFoundError as exc:
            raise CorruptChunkError(f"{self._where(pieces[0])}: missing from the store") from exc
        view = memoryview(stored)
        start = 0
        for piece in pieces:
            assert piece.length is not None
            end = start + piece.length
            if got < end:
                raise CorruptChunkError(f"{self._where(piece)}: truncated ({max(got - start, 0)} of {piece.length} "
                                        "bytes)")
            payload = verify_plain(view[start:end], self._where(piece))
            whole = _fills_target(piece)
            data = piece.target if whole else np.empty(piece.shape, dtype=self.dtype)
            codec.decode_into(payload, as_bytes(data), self._where(piece))
            if not whole:
                piece.target[...] = data[piece.inside]
            start = end
        return len(stored)

    def _where(self, piece: _Piece) -> str:
        return self._name(piece.chunk, piece.inner)

    def _name(self, coords: tuple[int, ...], inner: int | None = None) -> str:
        """A chunk, shard or inner chunk in errors: "chunk c.0.1", "shard c.1.0", "shard c.1.0 inner chunk 3"."""
        name = self.layout.chunk_key(coords)
        if inner is None:
            return f"{self.storage.url}: array {self.node!r} {'shard' if self.layout.sharded else 'chunk'} {name}"
        return f"{self.storage.url}: array {self.node!r} shard {name} inner chunk {inner}"

    def _index(self, value: StoredValue, coords) -> np.ndarray:
        index = self._indexes.get(coords)  # a dict's get is atomic: the lock is for the first reads of a shard
        if index is not None:
            return index
        try:
            tail = value.read_tail(self._index_bytes)
        except FileNotFoundError as exc:
            raise CorruptChunkError(f"{self._name(coords)}: missing from the store") from exc
        index = decode_shard_index(tail, self.layout, self._name(coords))
        with self._lock:
            self._indexes[coords] = index
        return index

    def _read_from_shard(self, key: str, coords, inside: tuple[slice, ...], target: np.ndarray) -> int:
        with self._open(key, coords) as value:
            return self._read_shard_pieces(value, self._index(value, coords), coords, inside, target)

    def _read_shard_pieces(self, value: StoredValue, index: np.ndarray, coords, inside: tuple[slice, ...],
                           target: np.ndarray) -> int:
        layout = self.layout
        inner = layout.inner_rows
        fetched = self._index_bytes
        inner_shape = layout.inner_chunk_shape
        row_slice, rest = inside[0], inside[1:]
        run: list[_Piece] = []
        run_end = 0  # where the run's last piece ends in the shard
        for i in range(row_slice.start // inner, (row_slice.stop - 1) // inner + 1):
            lo = max(row_slice.start, i * inner)
            hi = min(row_slice.stop, (i + 1) * inner)
            offset, length = index[i]
            piece = _Piece(int(offset), int(length), inner_shape,
                           (slice(lo - i * inner, hi - i * inner), *rest),
                           target[lo - row_slice.start: hi - row_slice.start], coords, i)
            if offset == MISSING:
                # The writer leaves out only inner chunks wholly in the edge padding, which no region reaches.
                raise CorruptChunkError(f"{self._where(piece)}: the shard index marks it missing")
            if run and run_end != piece.offset:  # not back to back: a request of its own
                fetched += self._read_run(value, run)
                run = []
            run.append(piece)
            run_end = int(offset) + int(length)
        if run:
            fetched += self._read_run(value, run)
        return fetched
