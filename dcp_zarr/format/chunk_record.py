"""The chunk record: what an incremental save needs to know of an earlier checkpoint's chunks without reading them.

For each array whose every chunk was written as one object through ``store_io/chunk_reuse.py`` (by the rank holding
it, or by an aggregator: collective/aggregated_writes.py), the manifest's ``chunks`` table holds the digest of the
array's ``zarr.json`` (its shape, grid, data type and codecs) and, for each chunk in the grid's C order, 28 bytes: the
xxh3-128 digest of the chunk's data as the state dict held it (before padding and encoding), the stored object's size,
and the crc32c of its stored data (the four bytes that end a plain chunk, or those before a shard's index: the
index's own crc32c covers only offsets and sizes). A later save whose array has the same ``zarr.json`` and whose
chunk's data has the same digest stores the same bytes, so it links the earlier object instead of writing it
(docs/design.md, "Incremental saves", says why a 128-bit digest is exact enough); the size and crc32c let it check the
object it linked.

An aggregated block's data is held in parts by several ranks, so its digest is ``parts_digest``: of each part's box
and its data's digest, which each rank computes for the parts it holds, so that a later save finds an unchanged
block without sending its bytes to the aggregator. The parts are the ranks' pieces within the block: saved by other
ranks, the same block has other parts and another digest, and is written anew rather than linked.

A chunk that had changed since the save's own earlier checkpoint is recorded ``UNHASHED`` (16 zero bytes where the
digest goes): it is likely to change again, and hashing it would cost as much as its crc32c. A later save finds such a
chunk unchanged by its size and crc32c and confirms it by comparing bytes (store_io/chunk_reuse.py). A real digest of
16 zero bytes would only send its chunk the same way.

An array whose every chunk is recorded ``UNHASHED`` changed whole (``ChunkRecord.changed_whole``): the next save
lays it out as a full save does, a shard per rank's box (of at most 16 inner chunks: ``ChunkLayout.shards_of_at_most``)
rather than an object per chunk (planning/write_plan.py), since an object per ~1 MiB chunk costs a full fine-tune's
saves their file count and only an unchanged chunk repays it.

An array none of whose chunks changed (``ArrayRecord.unchanged``: every chunk compared with the earlier checkpoint's
and found the same; LoRA's frozen weights) is laid out the same way by the next save, its shards hashed, and from then
on each shard is linked whole: one object (one server-side copy) where an object per chunk takes one for each ~1 MiB.
A chunk hashed with nothing to compare it with (a chain's first save, an array new to the save or laid out anew) says
nothing of whether it changed, so its array is not marked, but for an array laid out anew because it was unchanged.

The record is information for the next save only: nothing reads it to load a checkpoint.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import xxhash

HASH_NAME = "xxh3_128"
UNHASHED = bytes(16)  # the digest of a chunk the save did not hash
_ENTRY = struct.Struct("<16sQ4s")  # digest, stored size, crc32c of the stored data


class StoredChunk(NamedTuple):
    digest: bytes  # xxh3-128 of the chunk's data, 16 bytes, or UNHASHED
    size: int  # bytes of the stored object
    crc: bytes  # the crc32c of its stored data, as stored (4 bytes): store_io/chunk_reuse.py says where it lies


def data_digest(buffer) -> bytes:
    """The 16-byte xxh3-128 digest of a chunk's data (any contiguous buffer)."""
    return xxhash.xxh3_128_digest(buffer)


def parts_digest(parts: Iterable[tuple[Sequence[int], Sequence[int], bytes]]) -> bytes:
    """The 16-byte digest of a chunk made of ``parts``: ``(offsets, sizes, data_digest of the part's data in C
    order)`` of each, in the order given (the same on every rank: by offsets); the xxh3-128 digest of their boxes
    and digests."""
    hasher = xxhash.xxh3_128()
    for offsets, sizes, digest in parts:
        hasher.update(struct.pack(f"<{2 * len(offsets)}q", *offsets, *sizes))
        hasher.update(digest)
    return hasher.digest()


def metadata_digest(encoded_zarr_json: str) -> str:
    """The hex digest of an array's encoded ``zarr.json``: equal digests mean equal layouts, data types and codecs."""
    return xxhash.xxh3_128_hexdigest(encoded_zarr_json.encode())


class ArrayRecord(NamedTuple):
    metadata: str  # metadata_digest of the array's zarr.json
    chunks: tuple[StoredChunk, ...]  # in the grid's C order
    unchanged: bool = False  # every chunk found the same as the earlier checkpoint's (``ChunkRecord.unchanged_whole``)

    def to_json(self) -> dict:
        packed = b"".join(_ENTRY.pack(c.digest, c.size, c.crc) for c in self.chunks)
        document = {"metadata": self.metadata, "chunks": base64.b64encode(packed).decode()}
        return {**document, "unchanged": True} if self.unchanged else document

    @classmethod
    def from_json(cls, document) -> ArrayRecord:
        if not isinstance(document, dict) or not isinstance(document.get("metadata"), str) \
                or not isinstance(document.get("chunks"), str):
            raise ValueError("an array's record needs 'metadata' and 'chunks' strings")
        packed = base64.b64decode(document["chunks"], validate=True)
        if len(packed) % _ENTRY.size:
            raise ValueError(f"an array's chunks are {len(packed)} bytes, not a multiple of {_ENTRY.size}")
        unchanged = document.get("unchanged", False)
        if not isinstance(unchanged, bool):
            raise ValueError(f"an array's 'unchanged' is {unchanged!r}, not true or false")
        return cls(document["metadata"], tuple(StoredChunk(*fields) for fields in _ENTRY.iter_unpack(packed)),
                   unchanged)


class ChunkRecord(NamedTuple):
    """Node -> the record of each array saved whole through the chunk path; ``origin``: where reused chunks came
    from (``{"path", "save_id", "reused_chunks", "reused_bytes"}``), information only."""

    arrays: Mapping[str, ArrayRecord]
    origin: dict | None = None

    def to_json(self) -> dict:
        arrays = {node: self.arrays[node].to_json() for node in sorted(self.arrays)}
        document: dict = {"hash": HASH_NAME, "arrays": arrays}
        if self.origin is not None:
            document["incremental_from"] = self.origin
        return document

    @classmethod
    def from_json(cls, document, where: str) -> ChunkRecord:
        """The record of a manifest's ``chunks`` table; ValueError naming ``where`` if it is malformed or hashed
        otherwise."""
        if not isinstance(document, dict) or document.get("hash") != HASH_NAME \
                or not isinstance(document.get("arrays"), dict):
            raise ValueError(f"{where}: the manifest's chunk record is not an {HASH_NAME} record")
        try:
            arrays = {node: ArrayRecord.from_json(raw) for node, raw in document["arrays"].items()}
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: the manifest's chunk record is malformed: {exc}") from None
        return cls(arrays, document.get("incremental_from"))

    def changed_whole(self) -> frozenset[str]:
        """The nodes of the arrays whose every chunk had changed in the save that recorded them (all ``UNHASHED``):
        likely to change whole again, so the next save does not split them into an object per chunk."""
        return frozenset(node for node, array in self.arrays.items()
                         if array.chunks and all(chunk.digest == UNHASHED for chunk in array.chunks))

    def unchanged_whole(self) -> frozenset[str]:
        """The nodes of the arrays none of whose chunks had changed in the save that recorded them
        (``ArrayRecord.unchanged``): likely to stay unchanged, so the next save stores them as a full save does and
        links each shard whole rather than an object per chunk."""
        return frozenset(node for node, array in self.arrays.items() if array.unchanged)


def array_record(metadata: str, chunk_count: int, chunks: Iterable[tuple[int, StoredChunk]]) -> ArrayRecord | None:
    """The record of an array from ``(index in the grid's C order, chunk)`` pairs the ranks reported, or None
    unless every one of its ``chunk_count`` chunks is among them (an array written otherwise, in part or whole)."""
    by_index = dict(chunks)
    if len(by_index) != chunk_count or any(i not in by_index for i in range(chunk_count)):
        return None
    return ArrayRecord(metadata, tuple(by_index[i] for i in range(chunk_count)))
