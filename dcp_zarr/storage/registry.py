"""Which ``Storage`` class serves a location: a table of URL schemes, as fsspec's ``register_implementation`` is.

A path without a scheme, and ``file://``, is a local directory (``LocalStorage``); an object store's URL (``s3://``,
``gs://``, ``az://``, ...) goes to obstore (``ObstoreStorage``, which hands it to fsspec where obstore is missing or
``client="fsspec"`` is asked for); any other scheme goes to fsspec through zarr's ``FsspecStore``
(``ZarrStoreStorage``) unless a class was registered for it. A class is named by a
loader so that registering costs no import (zarr's, fsspec's) until a location of that scheme is opened.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from dcp_zarr.storage.base import Storage

StorageLoader = Callable[[], type[Storage]]

_LOCAL = ""  # the scheme of a plain path


def _local() -> type[Storage]:
    from dcp_zarr.storage.local import LocalStorage

    return LocalStorage


def _fsspec() -> type[Storage]:
    from dcp_zarr.storage.zarr_store import ZarrStoreStorage

    return ZarrStoreStorage


def _object_store() -> type[Storage]:
    from dcp_zarr.storage.obstore_storage import ObstoreStorage

    return ObstoreStorage


# The object stores obstore serves (storage/obstore_storage.py; fsspec's file systems where it is not installed)
OBJECT_STORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss")
_BY_SCHEME: dict[str, StorageLoader] = {_LOCAL: _local, "file": _local,
                                        **{scheme: _object_store for scheme in OBJECT_STORE_SCHEMES}}


def scheme_of(location: str | os.PathLike) -> str:
    """``"s3"`` of ``s3://bucket/x``; ``""`` of a plain path."""
    text = os.fspath(location)
    return text.split("://", 1)[0].lower() if "://" in text else _LOCAL


def register_storage(scheme: str, storage: type[Storage] | StorageLoader, *, replace: bool = False) -> None:
    """Serve locations of ``scheme`` (``"myfs"`` for ``myfs://...``) with ``storage``: a ``Storage`` subclass, or a
    function returning one. A scheme already registered is refused unless ``replace``."""
    if not scheme or "://" in scheme or "/" in scheme:
        raise ValueError(f"register_storage: {scheme!r} is not a URL scheme (e.g. 's3', without '://')")
    scheme = scheme.lower()
    if scheme in _BY_SCHEME and not replace:
        raise ValueError(f"register_storage: scheme {scheme!r} is registered already; pass replace=True to replace it")
    if isinstance(storage, type):
        if not issubclass(storage, Storage):
            raise TypeError(f"register_storage: {storage.__name__} is not a dcp_zarr Storage")
        storage_type = storage
        _BY_SCHEME[scheme] = lambda: storage_type
    else:
        _BY_SCHEME[scheme] = storage


def unregister_storage(scheme: str) -> None:
    """Forget a registered scheme (its locations go to fsspec again); the built-in local one stays."""
    if scheme.lower() in (_LOCAL, "file"):
        raise ValueError(f"unregister_storage: the local scheme {scheme!r} is built in")
    _BY_SCHEME.pop(scheme.lower(), None)


def storage_class(location: str | os.PathLike) -> type[Storage]:
    """The class that serves ``location`` (not opened: its capabilities can be asked without a request)."""
    return _BY_SCHEME.get(scheme_of(location), _fsspec)()
