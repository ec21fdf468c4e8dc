"""What a ``ZarrReader`` was made with, fixed for one load."""

from __future__ import annotations

import dataclasses
from typing import Any

from dcp_zarr.storage import Storage, default_aggregate_below, is_local, open_storage, store_objects
from dcp_zarr.storage.retry import Retrying


@dataclasses.dataclass(frozen=True, eq=False)
class LoadSettings:
    path: str
    store: Any  # a zarr store object instead of a path (ZarrReader(store=...))
    storage_options: dict | None
    thread_count: int
    safe_globals: list
    process_group: Any  # the group dcp.load runs on, over which reads are shared
    read_once: bool | None
    read_once_below: int | None
    exchange_bytes: int
    retrying: Retrying  # shared by every storage the reader opens (retry.py)

    def open(self) -> Storage:
        if self.store is not None:
            return store_objects.open_store(self.store, self.retrying)
        if not self.path:
            raise ValueError("ZarrReader needs a path or a store: pass path or store=, or checkpoint_id= to dcp.load")
        return open_storage(self.path, self.storage_options, read_only=True, retry=self.retrying)

    def label(self) -> str:
        return store_objects.label(self.store) if self.store is not None else self.path

    def shares_reads(self) -> bool:
        """``read_once``, or by default whether the storage's default aggregates. Ranks may decide apart (each sees
        its own mount): the coordinator's decides the root's broadcast, and reads are shared only where every
        rank's does (ZarrReader.prepare_global_plan)."""
        if self.read_once is not None:
            return self.read_once
        return default_aggregate_below(self.path, self.store, self.retrying) > 0  # object stores, shared FS

    def pauses_collector(self) -> bool:
        """Whether reads run with the garbage collector paused: a local path only (collector.py says why)."""
        return self.store is None and is_local(self.path)
