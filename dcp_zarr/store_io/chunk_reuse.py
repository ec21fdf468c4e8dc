"""One rank's chunks of an incremental save: each one linked from the earlier checkpoint where its stored bytes would
be the same, else written; and every chunk's entry of the new store's chunk record (format/chunk_record.py).

A chunk is linked only when its array's ``zarr.json`` is the earlier one's (same shape, grid, data type, codecs) and
its data's xxh3-128 digest is the earlier chunk's. The linked object is then checked against the record (its size and
last four bytes, the crc32c that ends it) before the save goes on: an earlier store changed since it was recorded
gives a chunk that is written anew, never a wrong one.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from dcp_zarr.errors import IncrementalBaseError, IncrementalSaveWarning
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.chunk_record import ArrayRecord, ChunkRecord, StoredChunk, data_digest, metadata_digest
from dcp_zarr.format.encoding import as_bytes, encode_chunk
from dcp_zarr.storage import Storage
from dcp_zarr.storage.registry import scheme_of

TAIL_BYTES = 4


class EarlierCheckpoint(NamedTuple):
    """The checkpoint an incremental save reuses: its storage, and the record of its chunks."""

    location: str
    save_id: str | None
    storage: Storage
    record: ChunkRecord


def check_earlier_location(earlier: str, path: str, store) -> None:
    """Refuse, naming it, an ``incremental_from`` that no save at ``path`` (or into ``store``) can reuse, whatever it
    holds: no I/O, so a writer checks it as it is made (``path`` empty: not known yet, checked at the save)."""
    if store is not None:
        raise IncrementalBaseError(
            f"incremental_from={earlier!r}: an incremental save needs the writer's path or URL (the earlier "
            "checkpoint is opened beside it), not store=; pass the path instead")
    if not path:
        return
    if _same_location(earlier, path):
        raise IncrementalBaseError(
            f"incremental_from={earlier!r} is the save's own path: a checkpoint cannot be saved from itself; pass "
            "the path of the previous checkpoint")
    if scheme_of(earlier) != scheme_of(path):
        raise IncrementalBaseError(
            f"incremental_from={earlier!r} is on other storage than the save ({path!r}): chunks are linked or "
            "copied within one storage; pass a checkpoint on the same storage, or save in full")



def _same_location(a: str, b: str) -> bool:
    if scheme_of(a) != scheme_of(b):
        return False
    if "://" not in a:
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")


class ReuseCounts(NamedTuple):
    linked_chunks: int
    linked_bytes: int
    written_chunks: int
    written_bytes: int


class ChunkReuse:
    """A rank's chunk writes in a save that records its chunks, reusing ``earlier``'s where it can (None: a save that
    starts a chain, recording only). Called from the IO threads."""

    def __init__(self, earlier: EarlierCheckpoint | None):
        self.earlier = earlier
        self.recorded: dict[str, dict[int, StoredChunk]] = defaultdict(dict)  # node -> grid index -> chunk
        self._lock = threading.Lock()
        self._counts = [0, 0, 0, 0]
        self._warned = False

    def earlier_array(self, node: str, encoded_zarr_json: str) -> ArrayRecord | None:
        """The earlier checkpoint's record of the array at ``node``, if its ``zarr.json`` is this save's."""
        if self.earlier is None:
            return None
        found = self.earlier.record.arrays.get(node)
        if found is None or found.metadata != metadata_digest(encoded_zarr_json):
            return None
        return found

    def store(self, storage: Storage, node: str, index: int, key: str, data: np.ndarray, layout: ChunkLayout,
              earlier: ArrayRecord | None) -> None:
        """Store the chunk at ``key`` (grid ``index`` of ``node``) holding ``data``, its unpadded content."""
        digest = data_digest(as_bytes(data))
        previous = earlier.chunks[index] if earlier is not None and index < len(earlier.chunks) else None
        if previous is not None and previous.digest == digest and self._linked(storage, key, previous):
            self._note(node, index, previous, linked=True)
            return
        buffers = encode_chunk(data, layout)
        storage.write(key, buffers)
        self._note(node, index, StoredChunk(digest, sum(memoryview(b).nbytes for b in buffers), _tail(buffers)),
                   linked=False)

    def counts(self) -> ReuseCounts:
        return ReuseCounts(*self._counts)

    def _linked(self, storage: Storage, key: str, previous: StoredChunk) -> bool:
        assert self.earlier is not None  # a previous chunk comes from it
        try:
            moved_nothing = storage.link_from(self.earlier.storage, key)
            same = storage.size(key) == previous.size and storage.read_tail(key, TAIL_BYTES) == previous.tail
        except OSError:  # the earlier checkpoint lost it (deleted since), or cannot give it: the chunk is written
            return False
        if not same:  # changed since it was recorded: the write that follows replaces the link
            return False
        if not moved_nothing:
            self._warn_once(storage)
        return True

    def _note(self, node: str, index: int, chunk: StoredChunk, linked: bool) -> None:
        with self._lock:
            self.recorded[node][index] = chunk
            slot = 0 if linked else 2
            self._counts[slot] += 1
            self._counts[slot + 1] += chunk.size

    def _warn_once(self, storage: Storage) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        assert self.earlier is not None
        warnings.warn(IncrementalSaveWarning(
            f"the incremental save into {storage.url} cannot link the chunks of {self.earlier.location} (another file "
            "system, or a store that cannot copy on its side): the unchanged chunks are copied through this process "
            "instead, so the save is complete but writes their bytes too"), stacklevel=2)


def _tail(buffers: list) -> bytes:
    """The last ``TAIL_BYTES`` bytes of the concatenation of ``buffers``."""
    tail = b""
    for buffer in reversed(buffers):
        view = memoryview(buffer).cast("B")
        tail = bytes(view[max(0, len(view) - (TAIL_BYTES - len(tail))):]) + tail
        if len(tail) >= TAIL_BYTES:
            break
    return tail
