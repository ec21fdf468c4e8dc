"""What a ``ZarrWriter`` was made with, fixed for one save: where it saves, and the options every rank must share."""

from __future__ import annotations

import dataclasses
from typing import Any

from dcp_zarr.format.compression import Compression
from dcp_zarr.storage import Storage, default_aggregate_below, is_local, open_storage, store_objects
from dcp_zarr.storage.retry import Retrying
from dcp_zarr.store_io import commit


@dataclasses.dataclass(frozen=True, eq=False)
class SaveSettings:
    path: str
    store: Any  # a zarr store object instead of a path (ZarrWriter(store=...))
    storage_options: dict | None
    thread_count: int
    sync_files: bool
    overwrite: bool | None
    inner_chunk_bytes: int
    check_replicas: str
    replica_check_bytes: int
    aggregate_below: int | None
    exchange_bytes: int
    retrying: Retrying  # one for every storage the writer opens: whether the store has answered yet (retry.py)
    compression: Compression | None = None

    def open(self, location: str) -> Storage:
        if self.store is not None:
            return store_objects.open_store(self.store, self.retrying)
        return open_storage(location, self.storage_options, sync_files=self.sync_files, retry=self.retrying)

    def replaces(self) -> bool:
        """Whether this save replaces a checkpoint at its target: ``overwrite``, or by default where the old one is
        kept until the new one is complete (a local path, or a ``LocalStore``, which resolve() made a path)."""
        if self.overwrite is not None:
            return self.overwrite
        return self.store is None and is_local(self.path)

    def aggregate_below_bytes(self) -> int:
        """The piece size under which arrays are aggregated: the writer's, else its storage's default."""
        if self.aggregate_below is not None:
            return self.aggregate_below
        return default_aggregate_below(self.path, self.store, self.retrying)

    def target(self) -> str:
        return store_objects.label(self.store) if self.store is not None else self.path

    def staging_location(self, save_id: str) -> str:
        # A store object is written in place, by each rank through its own store: the location is only a name.
        return self.target() if self.store is not None else commit.staging_location(self.path, save_id)

    def pauses_collector(self) -> bool:
        """Whether transfers run with the garbage collector paused: a local path only (collector.py says why)."""
        return self.store is None and is_local(self.path)
