"""Backends: a local directory (fast path) or any zarr store reached through a URL. Implementation: users pass paths,
URLs or zarr store objects to the public names in ``dcp_zarr``."""

from __future__ import annotations

import os

from dcp_zarr.storage.base import Storage
from dcp_zarr.storage.local import LocalStorage
from dcp_zarr.storage.local import local_path as _local_path
from dcp_zarr.storage.registry import register_storage, storage_class, unregister_storage
from dcp_zarr.storage.retry import Retrying, RetryPolicy

__all__ = ["Storage", "LocalStorage", "default_aggregate_below", "local_path", "open_storage",
           "register_storage", "storage_class", "unregister_storage"]


def local_path(location: str | os.PathLike) -> str:
    return _local_path(os.fspath(location))


def open_storage(location: str | os.PathLike, storage_options: dict | None = None, *, sync_files: bool = True,
                 read_only: bool = False, retry: RetryPolicy | Retrying | None = None) -> Storage:
    """The backend for a path or URL; ``storage_options`` go to fsspec (credentials, endpoint_url, ...).

    ``retry``: the policy of object-store calls, or a writer's or reader's ``Retrying`` to share (local paths have
    none)."""
    return storage_class(location).open(os.fspath(location), storage_options, sync_files=sync_files,
                                        read_only=read_only, retrying=as_retrying(retry))


def default_aggregate_below(location: str | os.PathLike, store=None, retry: Retrying | None = None) -> int:
    """The storage's ``aggregate_below`` for a path or URL, or a zarr store object, without opening a URL: a local
    path's by its file system (file_systems.py), a store object's by its kind, any URL's the base's (object stores)."""
    if store is not None:
        from dcp_zarr.storage import store_objects

        return store_objects.open_store(store, as_retrying(retry)).aggregate_below
    return storage_class(location).default_aggregate_below(os.fspath(location))


def as_retrying(retry: RetryPolicy | Retrying | None) -> Retrying:
    return retry if isinstance(retry, Retrying) else Retrying(retry)
