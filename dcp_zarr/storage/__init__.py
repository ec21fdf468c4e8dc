"""Backends: a local directory (fast path) or any zarr store reached through a URL."""

from __future__ import annotations

import os

from dcp_zarr.storage.base import Storage
from dcp_zarr.storage.local import LocalStorage

__all__ = ["Storage", "LocalStorage", "is_local", "local_path", "open_storage"]


def is_local(location: str | os.PathLike) -> bool:
    text = os.fspath(location)
    return "://" not in text or text.startswith("file://")


def local_path(location: str | os.PathLike) -> str:
    text = os.fspath(location)
    return os.path.abspath(text[len("file://"):] if text.startswith("file://") else text)


def open_storage(location: str | os.PathLike, storage_options: dict | None = None, *, sync_files: bool = True,
                 read_only: bool = False) -> Storage:
    """The backend for a path or URL; ``storage_options`` go to fsspec (credentials, endpoint_url, ...)."""
    if is_local(location):
        return LocalStorage(local_path(location), sync_files=sync_files)
    from zarr.storage import FsspecStore

    from dcp_zarr.storage.zarr_store import ZarrStoreStorage

    url = os.fspath(location)
    store = FsspecStore.from_url(url, storage_options=_with_connection_pool(url, storage_options),
                                 read_only=read_only)
    return ZarrStoreStorage(store, url)


def _with_connection_pool(url: str, storage_options: dict | None) -> dict | None:
    """s3fs's HTTP connection pool (botocore's default: 10) caps the requests in flight; make room for
    ``REQUESTS_IN_FLIGHT`` unless the caller chose a size (``config_kwargs={"max_pool_connections": N}``)."""
    if not url.startswith(("s3://", "s3a://")):
        return storage_options
    from dcp_zarr.storage.zarr_store import REQUESTS_IN_FLIGHT

    options = dict(storage_options or {})
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", REQUESTS_IN_FLIGHT)
    options["config_kwargs"] = config
    return options
