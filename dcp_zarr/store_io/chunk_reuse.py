"""One rank's chunks of an incremental save: each one linked from the earlier checkpoint where its stored bytes would
be the same, else written; and every chunk's entry of the new store's chunk record (format/chunk_record.py).

A chunk is linked only when its array's ``zarr.json`` is the earlier one's (same shape, grid, data type, codecs) and
its stored bytes are known to be the earlier chunk's, in one of two ways:

- the earlier record has the chunk's digest: the chunk's data is hashed (xxh3-128) and the digests compared;
- the earlier chunk is recorded ``UNHASHED`` (it had changed in its own save, so it is likely to have changed again):
  the chunk is encoded first, as a write needs; a size or crc32c unlike the record's means changed, and is written
  without any hash (what keeps a fully changed state's saves at a full save's cost); a match is confirmed by comparing
  the encoded bytes with the earlier object's, and only then hashed, for the next save.

A chunk found changed is recorded ``UNHASHED``; a chunk with nothing earlier to compare is hashed, except in an array
laid out anew because it changed whole in the earlier checkpoint (``ChunkRecord.changed_whole``): recorded
``UNHASHED``, so that the next save keeps its layout rather than going back to an object per chunk.

The linked object is then checked against the record (its size and the crc32c of its stored data) before the save
goes on: an earlier chunk replaced or rewritten since it was recorded gives a chunk that is written anew, never a
wrong one. A chunk damaged in place under its crc32c (bytes changed, size and crc32c not) is linked as it is and
fails its crc32c at load and in verify, as it does in the earlier checkpoint: catching it here would mean reading
every linked chunk, which is what linking saves.

That crc32c ends a plain chunk; a compressed chunk is a shard of one inner chunk, whose crc32c comes just before the
shard's index: the index's own crc32c, which ends the object, covers only offsets and sizes, the same in any two
shards whose data compressed to as many bytes. A shard of several inner chunks (an array that changed whole) is
recorded by the crc32c of its inner chunks' crc32c's, and a link to one is checked by reading its index (one ranged
read, one byte past the recorded end) and then the crc32c that ends each inner chunk (one small ranged read each),
never the shard's data. Such shards hold an array that changed whole in the earlier checkpoint, or one that did not
change at all (``ChunkRecord.unchanged_whole``), hashed when it is laid out so and linked whole from then on.

An aggregated block (collective/aggregated_writes.py) is a chunk like any other here, but its digest is its parts'
(``parts_digest``, passed as ``digest_of``), and an unchanged one is linked before its data reaches its aggregator
(``link_unchanged``): checked against the record alone, a block of several inner chunks as any such shard is (at
most 16 inner chunks: saving/settings.py's ``block_bytes``).
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np

from dcp_zarr.errors import CorruptChunkError, IncrementalBaseError, IncrementalSaveWarning
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.chunk_record import UNHASHED, ArrayRecord, ChunkRecord, StoredChunk, data_digest, metadata_digest
from dcp_zarr.format.encoding import (
    CHECKSUM_BYTES,
    MISSING,
    as_bytes,
    checksum,
    decode_shard_index,
    encode_chunk,
    shard_index_bytes,
)
from dcp_zarr.storage import Storage
from dcp_zarr.storage.location import directory_of
from dcp_zarr.storage.registry import scheme_of


class EarlierCheckpoint(NamedTuple):
    """The checkpoint an incremental save reuses: its storage, the record of its chunks, and the arrays that changed
    whole in it and that did not change at all (``ChunkRecord.changed_whole``, ``unchanged_whole``, found once: a
    pass over every chunk's entry)."""

    location: str
    save_id: str | None
    storage: Storage
    record: ChunkRecord
    changed_whole: frozenset[str] = frozenset()
    unchanged_whole: frozenset[str] = frozenset()


def check_earlier_location(earlier: str, path: str, store) -> None:
    """Refuse, naming it, an ``incremental_from`` that no save at ``path`` (or into ``store``) can reuse, whatever it
    holds: no I/O, so a writer checks it as it is made (``path`` empty: not known yet, checked at the save)."""
    if store is not None:
        raise IncrementalBaseError(
            f"incremental_from={earlier!r}: an incremental save needs the writer's path or URL (the earlier "
            "checkpoint is opened beside it), not store=; pass the path instead")
    if not path:
        return
    earlier_place, own_place = _place(earlier), _place(path)
    if earlier_place == own_place:
        raise IncrementalBaseError(
            f"incremental_from={earlier!r} is the save's own path: a checkpoint cannot be saved from itself; pass "
            "the path of the previous checkpoint")
    if earlier_place[0] != own_place[0]:
        raise IncrementalBaseError(
            f"incremental_from={earlier!r} is on other storage than the save ({path!r}): chunks are linked or "
            "copied within one storage; pass a checkpoint on the same storage, or save in full")


def _place(location: str) -> tuple[str, str]:
    """``(storage, where on it)``: ``("", real path)`` for a directory of this machine, a plain path and a ``file://``
    URL alike; else ``(scheme, URL without a trailing slash)``."""
    directory = directory_of(location)
    if directory is not None:
        return "", os.path.realpath(directory)
    return scheme_of(location), location.rstrip("/")


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
        self._whole = frozenset() if earlier is None else earlier.changed_whole

    def earlier_array(self, node: str, encoded_zarr_json: str) -> ArrayRecord | None:
        """The earlier checkpoint's record of the array at ``node``, if its ``zarr.json`` is this save's."""
        if self.earlier is None:
            return None
        found = self.earlier.record.arrays.get(node)
        if found is None or found.metadata != metadata_digest(encoded_zarr_json):
            return None
        return found

    def store(self, storage: Storage, node: str, index: int, key: str, data: np.ndarray, layout: ChunkLayout,
              earlier: ArrayRecord | None, digest_of: Callable[[], bytes] | None = None) -> None:
        """Store the chunk at ``key`` (grid ``index`` of ``node``) holding ``data``, its unpadded content.
        ``digest_of``: the chunk's digest where it is not its data's (an aggregated block's: ``parts_digest``)."""
        if digest_of is None:
            digest_of = partial(_data_digest, data)
        previous = self.previous(earlier, index)
        if previous is not None and previous.digest == UNHASHED:
            self._store_by_bytes(storage, node, index, key, data, layout, previous, digest_of)
            return
        if previous is None and node in self._whole:  # laid out anew, as it changed whole: not hashed (see above)
            self._write(storage, node, index, key, encode_chunk(data, layout), layout, UNHASHED)
            return
        digest = digest_of()
        if previous is not None and previous.digest == digest:
            linked = self._linked(storage, key, previous, layout)
            if linked is not None:
                self._note(node, index, previous, linked)
                return
        changed = previous is not None and previous.digest != digest
        self._write(storage, node, index, key, encode_chunk(data, layout), layout, UNHASHED if changed else digest)

    @staticmethod
    def previous(earlier: ArrayRecord | None, index: int) -> StoredChunk | None:
        """The earlier checkpoint's record of the chunk at grid ``index`` of an array (``earlier_array``)."""
        return earlier.chunks[index] if earlier is not None and index < len(earlier.chunks) else None

    def link_unchanged(self, storage: Storage, node: str, index: int, key: str, layout: ChunkLayout,
                       earlier: ArrayRecord | None, digest: bytes) -> bool:
        """Link the chunk at ``key`` from the earlier checkpoint, without its data at hand, if the record has its
        ``digest`` (an aggregated block that its holders found unchanged by the digests of their parts); whether it
        did. The linked object is checked against the record, as ``store`` checks it: its size and crc32c."""
        previous = self.previous(earlier, index)
        if previous is None or previous.digest == UNHASHED or previous.digest != digest:
            return False
        linked = self._linked(storage, key, previous, layout)
        if linked is None:
            return False
        self._note(node, index, previous, linked)
        return True

    def _store_by_bytes(self, storage: Storage, node: str, index: int, key: str, data: np.ndarray,
                        layout: ChunkLayout, previous: StoredChunk, digest_of: Callable[[], bytes]) -> None:
        """Store a chunk whose earlier one is recorded ``UNHASHED``: by its encoded size and crc32c, then its bytes."""
        buffers = encode_chunk(data, layout)
        stored = _stored(UNHASHED, buffers, layout)
        if (stored.size, stored.crc) == (previous.size, previous.crc) and self._earlier_holds(key, buffers):
            linked = self._linked(storage, key, previous, layout)
            if linked is not None:
                self._note(node, index, stored._replace(digest=digest_of()), linked)
                return
        self._write(storage, node, index, key, buffers, layout, UNHASHED)

    def _write(self, storage: Storage, node: str, index: int, key: str, buffers: list, layout: ChunkLayout,
               digest: bytes) -> None:
        """Write the chunk's ``buffers`` anew (replacing a link that did not hold what was recorded) and note it."""
        storage.write(key, buffers)
        self._note(node, index, _stored(digest, buffers, layout), linked=False)

    def counts(self) -> ReuseCounts:
        return ReuseCounts(*self._counts)

    def _earlier_holds(self, key: str, buffers: list) -> bool:
        """Whether the earlier checkpoint's object at ``key`` is the concatenation of ``buffers``, byte for byte."""
        assert self.earlier is not None  # a previous chunk comes from it
        try:
            held = self.earlier.storage.read(key)
        except OSError:  # gone since it was recorded: the chunk is written
            return False
        return held == b"".join(buffers)

    def _linked(self, storage: Storage, key: str, previous: StoredChunk, layout: ChunkLayout) -> bool | None:
        """Link the earlier object at ``key`` into ``storage``: None unless it then holds what ``previous`` records
        (its size and crc32c; for a shard of several inner chunks, the crc32c of its inner chunks' crc32c's), else
        True where the storage linked or copied it on its side, False where its bytes passed through this process
        (counted as written, as they were)."""
        assert self.earlier is not None  # a previous chunk comes from it
        try:
            moved_nothing = storage.link_from(self.earlier.storage, key)
            if layout.inner_chunks_per_chunk > 1:
                same = _shard_as_recorded(storage, key, previous, layout)
            else:
                same = _ends_as_recorded(storage, key, previous, _crc_before_end(layout) + CHECKSUM_BYTES)
        except OSError:  # the earlier checkpoint lost it (deleted since), or cannot give it: the chunk is written
            return None
        if not same:  # changed since it was recorded: the write that follows replaces the link
            return None
        if not moved_nothing:
            self._warn_once(storage)
        return moved_nothing

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


def _data_digest(data: np.ndarray) -> bytes:
    return data_digest(as_bytes(data))


def _shard_as_recorded(storage: Storage, key: str, recorded: StoredChunk, layout: ChunkLayout) -> bool:
    """Whether the object at ``key``, a shard of several inner chunks, has the recorded size and crc32c of its inner
    chunks' crc32c's (``_stored``), read without its data: its index (with one byte past the recorded end, as
    ``_ends_as_recorded`` reads), then the crc32c that ends each inner chunk the index lists."""
    index_bytes = shard_index_bytes(layout)
    if recorded.size < index_bytes:
        return False
    tail = storage.read_range(key, recorded.size - index_bytes, index_bytes + 1)
    if len(tail) != index_bytes:
        return False
    try:
        index = decode_shard_index(tail, layout, key)
    except CorruptChunkError:  # not the index the record's shard had
        return False
    crcs = []
    for offset, size in index.tolist():
        if offset == MISSING:
            continue
        end = offset + size
        if size < CHECKSUM_BYTES or end > recorded.size - index_bytes:  # not a shard of ours: not the recorded one
            return False
        crcs.append(storage.read_range(key, end - CHECKSUM_BYTES, CHECKSUM_BYTES))
    return checksum(b"".join(crcs)) == recorded.crc


def _crc_before_end(layout: ChunkLayout) -> int:
    """How many bytes follow the crc32c of a stored chunk's data: none in a plain chunk; a shard's index in a shard
    of one inner chunk (in a save that records its chunks: ``ChunkLayout.one_object_per_chunk``, then compressed)."""
    if not layout.sharded:
        return 0
    assert layout.inner_chunks_per_chunk == 1, "a shard of several inner chunks has a crc32c for each"
    return shard_index_bytes(layout)


def _ends_as_recorded(storage: Storage, key: str, recorded: StoredChunk, tail: int) -> bool:
    """Whether the object at ``key`` is ``recorded.size`` bytes long and holds the recorded crc32c where its last
    ``tail`` bytes begin: one ranged read of one byte past the recorded end (an object that long gives ``tail`` bytes
    back, a longer one more, a shorter one fewer), where a size and then a tail would take two requests."""
    if recorded.size < tail:
        return False
    found = storage.read_range(key, recorded.size - tail, tail + 1)
    return len(found) == tail and found[:CHECKSUM_BYTES] == recorded.crc


def _stored(digest: bytes, buffers: list, layout: ChunkLayout) -> StoredChunk:
    """The record of a chunk of ``layout`` stored as ``buffers``."""
    size = sum(memoryview(b).nbytes for b in buffers)
    if layout.inner_chunks_per_chunk > 1:
        return StoredChunk(digest, size, checksum(b"".join(_inner_crcs(buffers))))
    return StoredChunk(digest, size, _last_bytes(buffers, _crc_before_end(layout)))


def _inner_crcs(buffers: list) -> list[bytes]:
    """The crc32c of each inner chunk stored in the shard that ``buffers`` make (format/encoding.py: the inner
    chunks, then the index of (offset, size) pairs, then its crc32c), in the index's order."""
    index = np.frombuffer(buffers[-2], dtype="<u8").reshape(-1, 2)
    views = [memoryview(b).cast("B") for b in buffers[:-2]]
    ends = list(itertools.accumulate(len(v) for v in views))
    crcs = []
    for offset, size in index.tolist():
        if offset == MISSING:
            continue
        end = offset + size  # the inner chunk's crc32c ends it, in one buffer or across several
        at = bisect.bisect_left(ends, end)  # the buffer holding its last byte
        crc = b""
        while len(crc) < CHECKSUM_BYTES:
            start = ends[at] - len(views[at])
            crc = bytes(views[at][max(0, end - CHECKSUM_BYTES + len(crc) - start): end - start]) + crc
            end, at = start, at - 1
        crcs.append(crc)
    return crcs


def _last_bytes(buffers: list, skipped: int) -> bytes:
    """The ``CHECKSUM_BYTES`` bytes of the concatenation of ``buffers`` that end ``skipped`` bytes before its end."""
    wanted = skipped + CHECKSUM_BYTES
    tail = b""
    for buffer in reversed(buffers):
        view = memoryview(buffer).cast("B")
        tail = bytes(view[max(0, len(view) - (wanted - len(tail))):]) + tail
        if len(tail) >= wanted:
            break
    return tail[:CHECKSUM_BYTES]
