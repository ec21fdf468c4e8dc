"""Backends: a local directory (fast path) or any zarr store reached through a URL. Implementation: users pass paths,
URLs or zarr store objects to the public names in ``dcp_zarr``."""

from __future__ import annotations

import os

from dcp_zarr.storage.base import Storage
from dcp_zarr.storage.local import LocalStorage
from dcp_zarr.storage.retry import Retrying, RetryPolicy

__all__ = ["Storage", "LocalStorage", "default_aggregate_below", "is_local", "local_path", "open_storage"]


def is_local(location: str | os.PathLike) -> bool:
    text = os.fspath(location)
    return "://" not in text or text.startswith("file://")


def local_path(location: str | os.PathLike) -> str:
    text = os.fspath(location)
    return os.path.abspath(text[len("file://"):] if text.startswith("file://") else text)


def open_storage(location: str | os.PathLike, storage_options: dict | None = None, *, sync_files: bool = True,
                 read_only: bool = False, retry: RetryPolicy | Retrying | None = None) -> Storage:
    """The backend for a path or URL; ``storage_options`` go to fsspec (credentials, endpoint_url, ...).

    ``retry``: the policy of object-store calls, or a writer's or reader's ``Retrying`` to share (local paths have
    none)."""
    if is_local(location):
        return LocalStorage(local_path(location), sync_files=sync_files)
    from zarr.storage import FsspecStore

    from dcp_zarr.storage.zarr_store import ZarrStoreStorage

    url = os.fspath(location)
    store = FsspecStore.from_url(url, storage_options=_s3_client_options(url, storage_options), read_only=read_only)
    return ZarrStoreStorage(store, url, as_retrying(retry))


def default_aggregate_below(location: str | os.PathLike, store=None, retry: Retrying | None = None) -> int:
    """The storage's ``aggregate_below`` for a path or URL, or a zarr store object, without opening a URL: a local
    path's by its file system (file_systems.py), a store object's by its kind, any URL's the base's (object stores)."""
    if store is not None:
        from dcp_zarr.storage import store_objects

        return store_objects.open_store(store, as_retrying(retry)).aggregate_below
    if is_local(location):
        return LocalStorage(local_path(location)).aggregate_below
    return Storage.aggregate_below


def as_retrying(retry: RetryPolicy | Retrying | None) -> Retrying:
    return retry if isinstance(retry, Retrying) else Retrying(retry)


def _s3_client_options(url: str, storage_options: dict | None) -> dict | None:
    """Two botocore defaults overridden for ``s3://``, each unless the caller set it in ``config_kwargs``:

    * the HTTP connection pool (default 10) caps the requests in flight: make room for ``REQUESTS_IN_FLIGHT``;
    * botocore's own retries (5 attempts, backing off up to 20 s) would multiply dcp_zarr's (retry.py), and keep a
      refused endpoint's error from dcp_zarr for seconds per call (docs/crash-safety.md, "Object-store retries"):
      one attempt, so retry.py is the one layer.
    """
    if not url.startswith(("s3://", "s3a://")):
        return storage_options
    from dcp_zarr.storage.zarr_store import REQUESTS_IN_FLIGHT

    options = dict(storage_options or {})
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", REQUESTS_IN_FLIGHT)
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = config
    return options
