"""Backends: a local directory (fast path), object stores through obstore, any other zarr store through a URL or
given as a store object. ``location.py`` is the one door from a path, URL or store to a ``Storage``. Implementation:
users pass paths, URLs or zarr store objects to the public names in ``dcp_zarr``."""

from __future__ import annotations

from dcp_zarr.storage.base import Storage
from dcp_zarr.storage.local import LocalStorage
from dcp_zarr.storage.location import as_retrying, default_aggregate_below, directory_of, local_path, open_storage
from dcp_zarr.storage.registry import register_storage, storage_class, unregister_storage

__all__ = ["Storage", "LocalStorage", "as_retrying", "default_aggregate_below", "directory_of", "local_path",
           "open_storage", "register_storage", "storage_class", "unregister_storage"]
