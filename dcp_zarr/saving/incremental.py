"""Incremental saves, at both ends of a save: the earlier checkpoint checked and opened on every rank before anything
is written (``open_earlier``), and the new store's chunk record made by the coordinator from the ranks' reports
(``chunk_record``). The chunks themselves go through ``store_io/chunk_reuse.py``."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from dcp_zarr.errors import IncrementalBaseError, IncrementalSaveWarning, ZarrCheckpointError
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.chunk_record import UNHASHED, ArrayRecord, ChunkRecord, StoredChunk, array_record, metadata_digest
from dcp_zarr.format.manifest import FORMAT_VERSION
from dcp_zarr.saving.settings import SaveSettings
from dcp_zarr.store_io.chunk_reuse import ChunkReuse, EarlierCheckpoint, ReuseCounts, check_earlier_location
from dcp_zarr.store_io.root_document import read_manifest
from dcp_zarr.store_io.write_jobs import encoded_array_metadata

# The fqn of the one extra write result that carries a rank's chunk report in a save DCP planned.
CHUNKS_FQN = "__dcp_zarr_chunk_report__"


class ChunkReport(NamedTuple):
    """What a rank tells the coordinator of the chunks it stored: node -> [(grid index, chunk)], and its counts."""

    chunks: dict
    counts: ReuseCounts

    @classmethod
    def of(cls, reuse: ChunkReuse) -> ChunkReport:
        return cls({node: list(chunks.items()) for node, chunks in reuse.recorded.items()}, reuse.counts())


def open_earlier(settings: SaveSettings) -> EarlierCheckpoint | None:
    """The checkpoint ``settings.incremental_from`` names, checked and opened, or None for a save that reuses none.
    Raises ``IncrementalBaseError`` naming what is wrong with it, before anything is written."""
    earlier = settings.incremental_from
    if earlier is None:
        return None
    check_earlier_location(earlier, settings.path, settings.store)
    storage = settings.open(earlier)
    try:
        manifest = read_manifest(storage)
    except ZarrCheckpointError as exc:
        raise IncrementalBaseError(f"incremental_from={earlier!r} is not a complete checkpoint: {exc}") from None
    if manifest.format_version not in INCREMENTAL_BASE_VERSIONS:
        raise IncrementalBaseError(
            f"incremental_from={earlier!r} is of dcp_zarr format version {manifest.format_version}, this save writes "
            f"version {FORMAT_VERSION}: its chunks are not laid out as this save's; save in full (no "
            "incremental_from) to start a new chain")
    if manifest.chunk_record is None:
        warnings.warn(IncrementalSaveWarning(
            f"incremental_from={earlier!r} records no chunks (it was saved without incremental=True): this save "
            "writes every chunk, and records them, so that the next one reuses them"), stacklevel=3)
        record = ChunkRecord({})
    else:
        try:
            record = ChunkRecord.from_json(manifest.chunk_record, earlier)
        except ValueError as exc:
            raise IncrementalBaseError(f"incremental_from={earlier!r}: {exc}") from None
    return EarlierCheckpoint(earlier, manifest.save_id, storage, record, record.changed_whole(),
                             record.unchanged_whole())


# The formats whose chunks this save lays out alike: 7 only keeps one-element arrays in their fill_value, which a
# save never reuses.
INCREMENTAL_BASE_VERSIONS = (6, FORMAT_VERSION)


def whole_arrays(earlier: EarlierCheckpoint | None) -> frozenset[str]:
    """The arrays this save lays out as a full save does (not an object per chunk): those that changed whole in the
    earlier checkpoint, and those that did not change at all (``ChunkRecord.changed_whole``, ``unchanged_whole``)."""
    return frozenset() if earlier is None else earlier.changed_whole | earlier.unchanged_whole


def chunk_record(specs: dict[str, ArraySpec], reports: Iterable[ChunkReport], earlier: EarlierCheckpoint | None
                 ) -> dict:
    """The new store's chunk record (the manifest's ``chunks``): every array whose chunks the ranks all reported,
    and, where chunks were reused, where from (information only)."""
    chunks: dict[str, list[tuple[int, StoredChunk]]] = defaultdict(list)
    linked_chunks = linked_bytes = 0
    for report in reports:
        for node, stored in report.chunks.items():
            chunks[node].extend(stored)
        linked_chunks += report.counts.linked_chunks
        linked_bytes += report.counts.linked_bytes
    arrays = {}
    for spec in specs.values():
        record = array_record(metadata_digest(encoded_array_metadata(spec)), spec.layout.chunk_count,
                              chunks.get(spec.node, ()))
        if record is not None:
            arrays[spec.node] = record._replace(unchanged=_unchanged(spec.node, record, earlier))
    origin = None if earlier is None else {"path": earlier.location, "save_id": earlier.save_id,
                                           "reused_chunks": linked_chunks, "reused_bytes": linked_bytes}
    return ChunkRecord(arrays, origin).to_json()


def _unchanged(node: str, record: ArrayRecord, earlier: EarlierCheckpoint | None) -> bool:
    """Whether every chunk of the array at ``node`` was found the same as the earlier checkpoint's: each compared with
    it (the earlier record has the array, laid out alike, or the array was laid out anew because it was unchanged
    there) and none recorded ``UNHASHED``, as a changed one is."""
    if earlier is None or any(chunk.digest == UNHASHED for chunk in record.chunks):
        return False
    before = earlier.record.arrays.get(node)
    return node in earlier.unchanged_whole or (before is not None and before.metadata == record.metadata)
