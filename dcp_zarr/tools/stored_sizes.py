"""How many bytes each entry occupies in a store (its *stored* bytes), beside the tensor's own (its *logical* bytes),
for ``dcp-zarr inspect``.

What is counted is the data of the entry's array: its chunk (or shard) objects. Its ``zarr.json`` and the root's
manifest are not counted; a value held in the manifest (``kind == "value"``) stores no bytes of its own, nor does a
tensor kept in its array's fill_value (``Entry.fill``: format/fill_values.py).

* An array stored as it is: computed from its layout, nothing read. Every chunk holds its full chunk shape (edge
  chunks padded) and its crc32c; every shard holds its inner chunks, each at its full size with its crc32c, and its
  index. Inner chunks wholly in an edge shard's padding are not stored, and not counted (``encoding._shard``).
* A compressed array (``ChunkLayout.codec``, always sharded): each inner chunk's stored length is in its shard's
  index, so each shard's index is read (one small read per shard, at its tail, run on ``store_io/scheduler``'s
  threads within the storage's requests in flight) and its lengths added to the index's own bytes. An index that
  cannot be read, or that gives an inner chunk a length no compressed chunk can have, leaves the array's stored
  size unknown (``None``): ``dcp-zarr verify`` says what is wrong.
* ``torch.save`` bytes (``kind == "object"``): one chunk, the bytes and their crc32c.

Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

from dcp_zarr.errors import ZarrCheckpointError
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.encoding import (
    CHECKSUM_BYTES,
    MISSING,
    decode_shard_index,
    inner_chunk_stored_bytes,
    shard_index_bytes,
)
from dcp_zarr.format.manifest import OBJECT, TENSOR
from dcp_zarr.offline import Checkpoint, Entry
from dcp_zarr.store_io.scheduler import run_storage_jobs


def uncompressed_stored_bytes(layout: ChunkLayout, itemsize: int) -> int:
    """The bytes of every chunk (shard) of ``layout`` stored as it is, computed: the module docstring's count."""
    if layout.codec is not None:
        raise ValueError("a compressed array's stored size is in its shard indexes, not in its layout")
    if not layout.shape:  # 0-d: one chunk, one element
        return itemsize + CHECKSUM_BYTES
    if 0 in layout.shape:
        return 0  # no chunk at all
    across = math.prod(layout.grid_shape[1:])  # chunks side by side along the other dims: the same count of rows
    # along dim 0: whole chunks, then an edge chunk of the rows left (arithmetic: a grid may have millions of rows)
    whole, left = divmod(layout.shape[0], layout.chunk_shape[0])
    chunks = whole + (left > 0)
    if not layout.sharded:
        return across * chunks * (math.prod(layout.chunk_shape) * itemsize + CHECKSUM_BYTES)
    stored_inner = whole * layout.inner_chunks_per_chunk + -(-left // layout.inner_rows)
    return across * (stored_inner * inner_chunk_stored_bytes(layout, itemsize) + chunks * shard_index_bytes(layout))


def stored_sizes(ckpt: Checkpoint, entries: Iterable[Entry] | None = None) -> dict[str, int | None]:
    """``{fqn: stored bytes}`` of ``entries`` (every entry of ``ckpt`` when None); None where unknown."""
    chosen = list(ckpt if entries is None else entries)
    sizes: dict[str, int | None] = {}
    compressed: list[Entry] = []
    for entry in chosen:
        if entry.kind == OBJECT:
            sizes[entry.fqn] = entry.nbytes + CHECKSUM_BYTES
        elif entry.kind != TENSOR or entry.fill is not None:  # a value, or a tensor kept in its fill_value
            sizes[entry.fqn] = 0
        elif entry.codec is not None:
            compressed.append(entry)
        else:
            sizes[entry.fqn] = _computed(entry)
    sizes.update(_read_from_shard_indexes(ckpt, compressed))
    return {entry.fqn: sizes[entry.fqn] for entry in chosen}


def _computed(entry: Entry) -> int | None:
    assert entry.shape is not None and entry.chunk_shape is not None and entry.numpy_dtype is not None
    try:
        layout = ChunkLayout(entry.shape, entry.chunk_shape, entry.inner_chunk_rows)
        return uncompressed_stored_bytes(layout, entry.numpy_dtype.itemsize)
    except (ValueError, ZeroDivisionError):  # a manifest no save writes; verify and loads refuse it
        return None


def _read_from_shard_indexes(ckpt: Checkpoint, entries: list[Entry]) -> dict[str, int | None]:
    """The stored bytes of compressed arrays: each shard's index read, all of them in one run of small reads."""
    layouts: dict[str, ChunkLayout | None] = {}
    jobs = []
    owners: list[str] = []
    for entry in entries:
        try:  # the layout checked against the array's zarr.json (its copy in the root, for a store that holds one)
            layout = ckpt.region_reader(entry).layout
        except (ZarrCheckpointError, OSError):
            layouts[entry.fqn] = None
            continue
        layouts[entry.fqn] = layout
        itemsize = ckpt.region_reader(entry).dtype.itemsize
        for coords in layout.all_chunks():
            key = f"{entry.node}/{layout.chunk_key(coords)}"
            jobs.append((shard_index_bytes(layout), partial(_shard_bytes, ckpt, key, layout, itemsize)))
            owners.append(entry.fqn)
    found = run_storage_jobs(ckpt.storage, jobs, ckpt.thread_count, name="dcp-zarr-sizes")
    sizes: dict[str, int | None] = {fqn: 0 if layout is not None else None for fqn, layout in layouts.items()}
    for fqn, nbytes in zip(owners, found):
        total = sizes[fqn]
        sizes[fqn] = None if total is None or nbytes is None else total + nbytes
    return sizes


def _shard_bytes(ckpt: Checkpoint, key: str, layout: ChunkLayout, itemsize: int) -> int | None:
    """A compressed shard's stored bytes by its index; None where the index is missing, corrupt or not one a save
    writes (an inner chunk longer than any compressed inner chunk can be)."""
    try:
        index = decode_shard_index(ckpt.storage.read_tail(key, shard_index_bytes(layout)), layout, key)
    except (ZarrCheckpointError, OSError):
        return None
    lengths = index[index[:, 0] != MISSING, 1]
    most = inner_chunk_stored_bytes(layout, itemsize)
    if len(lengths) and not (CHECKSUM_BYTES < int(lengths.min()) and int(lengths.max()) <= most):
        return None
    return shard_index_bytes(layout) + int(lengths.sum())
