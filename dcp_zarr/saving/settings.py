"""What a ``ZarrWriter`` was made with: made once per writer, checked as it is made, fixed for each save (a new
``checkpoint_id`` gives a copy with another path)."""

from __future__ import annotations

import dataclasses
import os

from dcp_zarr.collective.transfer import DEFAULT_EXCHANGE_BYTES
from dcp_zarr.format.chunk_layout import INNER_CHUNK_TARGET_BYTES, WHOLE_ARRAY_SHARD_INNER_CHUNKS
from dcp_zarr.format.compression import Compression
from dcp_zarr.planning import replicas
from dcp_zarr.storage import storage_class
from dcp_zarr.store_io import commit
from dcp_zarr.store_io.chunk_reuse import check_earlier_location
from dcp_zarr.store_io.target import StoreTarget, check_bytes


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class SaveSettings(StoreTarget):
    sync_files: bool = True
    overwrite: bool | None = None
    inner_chunk_bytes: int = INNER_CHUNK_TARGET_BYTES
    check_replicas: str = replicas.SMALL
    replica_check_bytes: int = replicas.DEFAULT_MAX_BYTES
    aggregate_below: int | None = None
    exchange_bytes: int = DEFAULT_EXCHANGE_BYTES
    compression: Compression | None = None  # Compression.of the writer's argument
    incremental: bool = False  # one object per chunk, each recorded, so that a later save can reuse them
    incremental_from: str | None = None  # the checkpoint this save reuses chunks of (saving/incremental.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.check_replicas not in replicas.CHECK_MODES:
            raise ValueError(f"check_replicas={self.check_replicas!r}: expected one of "
                             f"{', '.join(replicas.CHECK_MODES)}")
        object.__setattr__(self, "replica_check_bytes", int(self.replica_check_bytes))
        if self.overwrite not in (None, True, False):
            raise ValueError(f"overwrite={self.overwrite!r}: expected True, False or None (replace only where the "
                             "old checkpoint survives until the new one is complete)")
        check_bytes("aggregate_below", self.aggregate_below, 0, none_for_default=True)
        check_bytes("exchange_bytes", self.exchange_bytes, 1)
        if self.incremental_from is not None:
            if not isinstance(self.incremental_from, (str, os.PathLike)) or not os.fspath(self.incremental_from):
                raise ValueError(f"incremental_from={self.incremental_from!r}: expected the path or URL of an earlier "
                                 "checkpoint")
            if not self.incremental:
                raise ValueError(f"incremental_from={self.incremental_from!r} with incremental=False: an incremental "
                                 "save is one that records its chunks; leave incremental at its default")
            object.__setattr__(self, "incremental_from", os.fspath(self.incremental_from))
            check_earlier_location(self.incremental_from, self.path, self.store)

    def _open_options(self) -> dict:
        return {"sync_files": self.sync_files}

    def replaces(self) -> bool:
        """Whether this save replaces a checkpoint at its target: ``overwrite``, or by default where the old one is
        kept until the new one is complete, which a storage that commits by a rename does (a local path, or a
        ``LocalStore``, which resolve() made a path)."""
        if self.overwrite is not None:
            return self.overwrite
        return self.store is None and storage_class(self.path).commits_by_rename

    def aggregate_below_bytes(self) -> int:
        """The piece size under which arrays are aggregated: the writer's, else its storage's default; in a save that
        records its chunks (incremental), at least ``inner_chunk_bytes``, even where the storage's default is 0 (a
        machine's own disk). Such a save never writes a shard that ranks fill at offsets, so an array held in
        pieces smaller than a chunk would be an object per piece where a full save writes one: aggregated, it is
        one object per block, as in a full save, which its aggregator links whole where it is unchanged
        (collective/aggregated_writes.py)."""
        if self.aggregate_below is not None:
            return self.aggregate_below
        if self.incremental:
            return max(self.storage_aggregate_below(), self.inner_chunk_bytes)
        return self.storage_aggregate_below()

    def block_bytes(self) -> int:
        """The largest block an aggregator writes as one object, and the bytes it holds in a round:
        ``exchange_bytes``; in a save that records its chunks, at most ``WHOLE_ARRAY_SHARD_INNER_CHUNKS`` chunks, as
        an array that changed whole is cut. A block is the unit of reuse of its rows: a changed row rewrites it whole,
        and one linked is checked by reading it (store_io/chunk_reuse.py), so both stay about 16 MiB at most."""
        if not self.incremental:
            return self.exchange_bytes
        return min(self.exchange_bytes, WHOLE_ARRAY_SHARD_INNER_CHUNKS * self.inner_chunk_bytes)

    def staging_location(self, save_id: str) -> str:
        # A store object is written in place, by each rank through its own store: the location is only a name.
        return self.label() if self.store is not None else commit.staging_location(self.path, save_id)
