"""Moving array data between tensors and stored chunks: which keys a shard writes, and reading any region back."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np

from dcp_zarr.encoding import (
    MISSING,
    decode_shard_index,
    encode_chunk,
    rows_from_payload,
    shard_index_bytes,
    verify_plain,
)
from dcp_zarr.errors import CorruptChunkError
from dcp_zarr.layout import ChunkLayout, chunk_key
from dcp_zarr.storage import Storage


def chunk_writes(node: str, layout: ChunkLayout, box_offsets: Sequence[int], local: np.ndarray) -> Iterator[tuple[str, list]]:
    """``(key, buffers)`` for every chunk of the box that ``local`` (a rank's shard at ``box_offsets``) covers.

    The box must be a union of whole chunks (``chunk_layout_for_boxes`` guarantees it); buffers alias ``local``'s
    memory wherever the chunk is a contiguous run of it.
    """
    sizes = local.shape
    for coords in layout.chunks_in_box(box_offsets, sizes):
        offsets, extent = layout.chunk_box(coords)
        start = [o - b for o, b in zip(offsets, box_offsets)]
        if any(s < 0 or s + e > n for s, e, n in zip(start, extent, sizes)):
            raise AssertionError(f"{node}: chunk {coords} is not inside the saved box at {tuple(box_offsets)}")
        data = local[tuple(slice(s, s + e) for s, e in zip(start, extent))]
        yield f"{node}/{chunk_key(coords)}", encode_chunk(data, layout)


class RegionReader:
    """Reads regions of one stored array into numpy views, verifying every chunk it touches.

    Shard indexes are cached, so reading many regions of one shard fetches its index once. Thread-safe.
    """

    def __init__(self, storage: Storage, node: str, layout: ChunkLayout, dtype: np.dtype):
        self.storage = storage
        self.node = node
        self.layout = layout
        self.dtype = dtype
        self._indexes: dict[tuple[int, ...], np.ndarray | None] = {}
        self._lock = threading.Lock()

    def read_into(self, offsets: Sequence[int], out: np.ndarray) -> int:
        """Fill ``out`` with the region of the array starting at ``offsets``; returns the bytes fetched."""
        layout = self.layout
        fetched = 0
        if out.ndim == 0:
            rows, fetched = self._rows(())
            out[()] = rows[()]
            return fetched
        for coords in layout.chunks_in_box(offsets, out.shape):
            chunk_offsets, chunk_extent = layout.chunk_box(coords)
            lo = [max(o, c) for o, c in zip(offsets, chunk_offsets)]
            hi = [min(o + n, c + e) for o, n, c, e in zip(offsets, out.shape, chunk_offsets, chunk_extent)]
            target = out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
            inside = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk_offsets))
            if layout.sharded:
                fetched += self._read_from_shard(coords, inside, target)
            else:
                rows, n = self._rows(coords)
                target[...] = rows[inside]
                fetched += n
        return fetched

    def _where(self, coords) -> str:
        return f"array {self.node!r} chunk {chunk_key(coords)}"

    def _rows(self, coords) -> tuple[np.ndarray, int]:
        key = f"{self.node}/{chunk_key(coords)}"
        try:
            raw = self.storage.read(key)
        except FileNotFoundError as exc:
            raise CorruptChunkError(f"{self._where(coords)}: chunk is missing from the store") from exc
        payload = verify_plain(raw, self._where(coords))
        return rows_from_payload(payload, self.dtype, self.layout.chunk_shape, self._where(coords)), len(raw)

    def _index(self, coords) -> np.ndarray:
        with self._lock:
            if coords in self._indexes:
                return self._indexes[coords]
        key = f"{self.node}/{chunk_key(coords)}"
        try:
            tail = self.storage.read_tail(key, shard_index_bytes(self.layout))
        except FileNotFoundError as exc:
            raise CorruptChunkError(f"{self._where(coords)}: shard is missing from the store") from exc
        index = decode_shard_index(tail, self.layout, self._where(coords))
        with self._lock:
            self._indexes[coords] = index
        return index

    def _read_from_shard(self, coords, inside: tuple[slice, ...], target: np.ndarray) -> int:
        layout = self.layout
        index = self._index(coords)
        inner = layout.inner_rows
        inner_shape = layout.inner_chunk_shape
        key = f"{self.node}/{chunk_key(coords)}"
        fetched = shard_index_bytes(layout)
        row_slice, rest = inside[0], inside[1:]
        for i in range(row_slice.start // inner, (row_slice.stop - 1) // inner + 1):
            lo = max(row_slice.start, i * inner)
            hi = min(row_slice.stop, (i + 1) * inner)
            dest = target[lo - row_slice.start : hi - row_slice.start]
            offset, length = index[i]
            where = f"{self._where(coords)} inner chunk {i}"
            if offset == MISSING:
                # The writer leaves out only inner chunks wholly in the edge padding, which no region reaches.
                raise CorruptChunkError(f"{where}: the shard index marks it missing")
            raw = self.storage.read_range(key, int(offset), int(length))
            if len(raw) != int(length):
                raise CorruptChunkError(f"{where}: shard is truncated")
            rows = rows_from_payload(verify_plain(raw, where), self.dtype, inner_shape, where)
            dest[...] = rows[(slice(lo - i * inner, hi - i * inner), *rest)]
            fetched += len(raw)
        return fetched
