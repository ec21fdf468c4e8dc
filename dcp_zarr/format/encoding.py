"""Chunks and array metadata byte-for-byte as zarr v3 writes them, without zarr's per-chunk pipeline.

Every array uses one of two codec chains, both readable by zarr-python and TensorStore:

* plain:   ``bytes`` (little endian) -> ``crc32c``: the chunk's C-order bytes followed by their 4-byte crc32c;
* sharded: ``sharding_indexed`` whose inner chunks use the plain chain, index at the end (16 bytes per inner chunk,
  offset and length as little-endian uint64, then the index's own crc32c);
* compressed (``ChunkLayout.codec``, always sharded): inner chunks ``bytes`` -> the codec -> ``crc32c``, the crc32c
  of the compressed bytes (format/codecs.py).

Writing the bytes ourselves lets a rank hand tensor memory straight to ``writev`` (no copy) and skip zarr's
per-chunk pipeline, a fixed cost per chunk that a checkpoint of thousands of chunks multiplies;
``tests/format/test_zarr_interop.py`` proves the result is what zarr and TensorStore read.
"""

from __future__ import annotations

import functools
import math

import crc32c
import numpy as np

from dcp_zarr.errors import CorruptChunkError, MalformedMetadataError
from dcp_zarr.format.chunk_layout import CHUNK_KEY_SEPARATORS, ChunkLayout, dimension_names
from dcp_zarr.format.codecs import Codec, codec_from_json, codec_kind

CHECKSUM_BYTES = 4
INDEX_ENTRY_BYTES = 16
MISSING = np.uint64(2**64 - 1)


def checksum(buffer) -> bytes:
    return crc32c.crc32c(buffer).to_bytes(CHECKSUM_BYTES, "little")


def as_bytes(array: np.ndarray) -> memoryview:
    """The array's bytes as a flat memoryview, without copying (the array must be C-contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def chunk_rows(data: np.ndarray, layout: ChunkLayout) -> np.ndarray:
    """The chunk's data as a C-contiguous array padded along every dim but the first to the chunk shape.

    Padding along dim 0 is left to the caller (it is a run of zero bytes at the end), so the common case - a
    contiguous shard whose chunks span whole rows - needs no copy at all.
    """
    width = layout.chunk_shape[1:]
    if tuple(data.shape[1:]) == tuple(width):
        return np.ascontiguousarray(data)
    padded = np.zeros((data.shape[0], *width), dtype=data.dtype)
    padded[tuple(slice(0, n) for n in data.shape)] = data
    return padded


def encode_chunk(data: np.ndarray, layout: ChunkLayout) -> list:
    """Buffers whose concatenation is the stored chunk (shard) holding ``data``, the chunk's unpadded content."""
    rows = chunk_rows(data, layout) if data.ndim else np.ascontiguousarray(data)
    if not layout.sharded:
        return _plain(rows, layout.chunk_shape[0] if layout.chunk_shape else None)
    return _shard(rows, layout)


def _compressed(rows: np.ndarray, full_rows: int, codec: Codec) -> list:
    """A compressed inner chunk: its rows padded to ``full_rows`` (zeros), compressed, then their crc32c."""
    if rows.shape[0] != full_rows:
        padded = np.zeros((full_rows, *rows.shape[1:]), dtype=rows.dtype)
        padded[: rows.shape[0]] = rows
        rows = padded
    stored = codec.encode(np.ascontiguousarray(rows))
    return [stored, checksum(stored)]


def _row_bytes(rows: np.ndarray) -> int:
    return math.prod(rows.shape[1:]) * rows.itemsize


def _plain(rows: np.ndarray, full_rows: int | None) -> list:
    payload = as_bytes(rows)
    pad = (full_rows - rows.shape[0]) * _row_bytes(rows) if full_rows is not None else 0
    crc = crc32c.crc32c(payload)
    if pad:
        zeros = bytes(pad)
        crc = crc32c.crc32c(zeros, crc)
        return [payload, zeros, crc.to_bytes(CHECKSUM_BYTES, "little")]
    return [payload, crc.to_bytes(CHECKSUM_BYTES, "little")]


def _inner_chunks(rows: np.ndarray, inner: int, codec: Codec | None = None) -> list[list]:
    """The buffers of each inner chunk holding ``rows``, in order, the last one padded to ``inner`` rows."""
    if codec is not None:
        return [_compressed(rows[start: start + inner], inner, codec) for start in range(0, rows.shape[0], inner)]
    return [_plain(rows[start: start + inner], inner) for start in range(0, rows.shape[0], inner)]


def _shard(rows: np.ndarray, layout: ChunkLayout) -> list:
    # Inner chunks wholly in the edge padding are not stored and stay missing: readers return the fill value (zero).
    index = np.full((layout.inner_chunks_per_chunk, 2), MISSING, dtype="<u8")
    buffers: list = []
    offset = 0
    for i, parts in enumerate(_inner_chunks(rows, layout.inner_rows, layout.codec)):
        size = sum(len(p) for p in parts)
        index[i] = (offset, size)
        offset += size
        buffers.extend(parts)
    index_bytes = index.tobytes()
    buffers.extend([index_bytes, checksum(index_bytes)])
    return buffers


def inner_chunk_stored_bytes(layout: ChunkLayout, itemsize: int) -> int:
    """The stored size of every inner chunk of a sharded layout: its payload at full size, then its crc32c (for a
    compressed layout, the most it can be: the codec's most on data that does not compress)."""
    payload = math.prod(layout.inner_chunk_shape) * itemsize
    overhead = layout.codec.overhead(payload) if layout.codec is not None else 0
    return payload + overhead + CHECKSUM_BYTES


def encode_inner_chunks(rows: np.ndarray, layout: ChunkLayout) -> list:
    """Buffers of consecutive inner chunks holding ``rows`` (whole inner chunks of a shard spanning the array, the
    last one padded if the array ends inside it), each with its crc32c: what goes at the first one's offset."""
    assert layout.fixed_offsets, "compressed inner chunks have no offsets known in advance"
    return [buffer for parts in _inner_chunks(chunk_rows(rows, layout), layout.inner_rows) for buffer in parts]


def full_shard_index(layout: ChunkLayout, itemsize: int) -> list:
    """The index of a shard whose inner chunks are all stored, in order, each at its full size; and its crc32c.
    Written at offset ``inner_chunks_per_chunk * inner_chunk_stored_bytes`` (zarr's index_location "end")."""
    return list(_full_shard_index(layout.inner_chunks_per_chunk, inner_chunk_stored_bytes(layout, itemsize)))


@functools.lru_cache(maxsize=256)
def _full_shard_index(count: int, size: int) -> tuple[bytes, bytes]:
    # the same few bytes for every array of a model's few shapes: made once each, not once per array per save
    index = np.empty((count, 2), dtype="<u8")
    index[:, 0] = np.arange(count, dtype="<u8") * size
    index[:, 1] = size
    index_bytes = index.tobytes()
    return index_bytes, checksum(index_bytes)


def shard_index_bytes(layout: ChunkLayout) -> int:
    return layout.inner_chunks_per_chunk * INDEX_ENTRY_BYTES + CHECKSUM_BYTES


def verify_stored(buffer, layout: ChunkLayout, itemsize: int, where: str) -> None:
    """Check one stored inner chunk (or chunk) of ``layout``: its crc32c and, compressed, that it decompresses to
    its full size; CorruptChunkError naming ``where`` otherwise (``verify`` reads a store through this)."""
    payload = verify_plain(buffer, where)
    expected = math.prod(layout.inner_chunk_shape) * itemsize
    if layout.codec is None:
        if len(payload) != expected:
            raise CorruptChunkError(f"{where}: chunk holds {len(payload) + CHECKSUM_BYTES} bytes, expected "
                                    f"{expected + CHECKSUM_BYTES}")
        return
    layout.codec.decode_into(payload, memoryview(bytearray(expected)), where)


def verify_plain(buffer, where: str) -> memoryview:
    """The payload of a plain-encoded chunk after checking its crc32c; ``where`` names the array and chunk."""
    view = memoryview(buffer).cast("B")
    if len(view) < CHECKSUM_BYTES:
        raise CorruptChunkError(f"{where}: chunk is truncated ({len(view)} bytes, no checksum)")
    payload, stored = view[:-CHECKSUM_BYTES], bytes(view[-CHECKSUM_BYTES:])
    if checksum(payload) != stored:
        raise CorruptChunkError(f"{where}: crc32c mismatch (the chunk is corrupt or truncated)")
    return payload


def decode_shard_index(buffer, layout: ChunkLayout, where: str) -> np.ndarray:
    """The (offset, length) table of a shard, checksum verified; rows of MISSING mark absent inner chunks."""
    payload = verify_plain(buffer, f"{where} (shard index)")
    count = layout.inner_chunks_per_chunk
    if len(payload) != count * INDEX_ENTRY_BYTES:
        raise CorruptChunkError(f"{where}: shard index has {len(payload)} bytes, expected {count * INDEX_ENTRY_BYTES}")
    return np.frombuffer(payload, dtype="<u8").reshape(count, 2)


def fill_value_json(data_type: str):
    if data_type == "bool":
        return False
    if data_type.startswith("complex"):
        return [0.0, 0.0]
    if data_type.startswith(("int", "uint")):
        return 0
    return 0.0


def _bytes_codec(itemsize: int) -> dict:
    return {"name": "bytes", "configuration": {"endian": "little"}} if itemsize > 1 else {"name": "bytes"}


def array_metadata(layout: ChunkLayout, data_type: str, itemsize: int, attributes: dict | None = None, *,
                   node: str = "", fill_value=None) -> dict:
    """The zarr.json document of the array at ``node`` with this layout (zarr v3 core spec); ``fill_value``: the
    value of an array kept in it (fill_values.py), else the data type's zero."""
    compression = [layout.codec.to_json()] if layout.codec is not None else []
    plain_codecs = [_bytes_codec(itemsize), *compression, {"name": "crc32c"}]
    if layout.sharded:
        codecs = [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(layout.inner_chunk_shape),
                "codecs": plain_codecs,
                "index_codecs": [_bytes_codec(8), {"name": "crc32c"}],
                "index_location": "end",
            },
        }]
    else:
        codecs = plain_codecs
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(layout.shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(layout.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": layout.separator}},
        "fill_value": fill_value_json(data_type) if fill_value is None else fill_value,
        "codecs": codecs,
        "attributes": attributes or {},
        "dimension_names": dimension_names(node, len(layout.shape)),
        "storage_transformers": [],
    }


def group_metadata(attributes: dict | None = None) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def layout_from_array_metadata(meta: dict, where: str) -> ChunkLayout:
    """Read back a layout this module wrote; anything else is refused with a message naming ``where``."""
    try:
        shape = tuple(int(n) for n in meta["shape"])
        chunk_shape = tuple(int(n) for n in meta["chunk_grid"]["configuration"]["chunk_shape"])
        codecs = meta["codecs"]
        inner_rows = 0
        if codecs and codecs[0]["name"] == "sharding_indexed":
            inner_rows = int(codecs[0]["configuration"]["chunk_shape"][0])
            codecs = codecs[0]["configuration"]["codecs"]
        # a codec the table does not know is left to the zarr.json check (format/array_checks.py), which names it
        known = [c for c in codecs if isinstance(c, dict) and codec_kind(c.get("name")) is not None]
        codec = codec_from_json(known[0], where) if len(known) == 1 else None
        separator = meta["chunk_key_encoding"]["configuration"]["separator"]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise MalformedMetadataError(f"{where}: zarr.json is malformed ({exc!r})") from exc
    if len(chunk_shape) != len(shape) or any(c < 1 for c in chunk_shape) or any(n < 0 for n in shape):
        raise MalformedMetadataError(f"{where}: zarr.json has shape {shape} and chunk shape {chunk_shape}")
    if inner_rows and (chunk_shape[0] % inner_rows):
        raise MalformedMetadataError(f"{where}: inner chunk rows {inner_rows} do not divide {chunk_shape[0]}")
    if separator not in CHUNK_KEY_SEPARATORS:
        raise MalformedMetadataError(f"{where}: zarr.json has chunk key separator {separator!r}, not one of "
                                     f"{' or '.join(map(repr, CHUNK_KEY_SEPARATORS))}")
    if codec is not None and not inner_rows:
        raise MalformedMetadataError(f"{where}: a compressed array is sharded when dcp_zarr writes it")
    return ChunkLayout(shape, chunk_shape, inner_rows, separator, codec)
