"""A location becomes storage here, and only here: a path, a URL (with its ``storage_options``) or a zarr store
object, opened with one ``Retrying`` (the policy and the has-it-answered state of one writer, reader or manager).

Every caller, the writer's and reader's targets, ``open_checkpoint``, the lifecycle's roots, the tools, opens through
``open_storage`` and asks a location's directory through ``directory_of``, as zarr-python's ``make_store_path`` is its
one door. Which class serves a location is the registry's (registry.py); what a store object is, store_objects.py's.
"""

from __future__ import annotations

import os

from dcp_zarr.storage import store_objects
from dcp_zarr.storage.base import Storage
from dcp_zarr.storage.local import local_path as _local_path
from dcp_zarr.storage.registry import storage_class
from dcp_zarr.storage.retry import Retrying, RetryPolicy


def as_retrying(retry: RetryPolicy | Retrying | None) -> Retrying:
    """A writer's or reader's ``Retrying`` as it is, or a fresh one with ``retry``'s policy (None: the default)."""
    return retry if isinstance(retry, Retrying) else Retrying(retry)


def open_storage(location: str | os.PathLike | None = None, storage_options: dict | None = None, *, store=None,
                 sync_files: bool = True, read_only: bool = False,
                 retry: RetryPolicy | Retrying | None = None) -> Storage:
    """The storage of a path or URL (``storage_options``: endpoint, credentials, ``client``; docs/object-stores.md),
    or of a zarr store object given as ``store=`` (used as it is: ``location`` and the options must be unset).

    ``retry``: the policy of object-store calls, or a writer's or reader's ``Retrying`` to share (local paths have
    none)."""
    retrying = as_retrying(retry)
    if store is not None:
        if location:
            raise ValueError(f"open_storage: pass either a location ({os.fspath(location)!r}) or store=, not both")
        return store_objects.open_store(store, retrying)
    if location is None or not os.fspath(location):
        raise ValueError("open_storage: a path or URL, or store=, is needed")
    location = os.fspath(location)
    return storage_class(location).open(location, storage_options, sync_files=sync_files, read_only=read_only,
                                        retrying=retrying)


def directory_of(location: str | os.PathLike) -> str | None:
    """The directory on this machine that ``location`` names (a path, ``file://``), or None (an object store's
    prefix, any other URL): asked of the class that serves it, without opening it."""
    location = os.fspath(location)
    return storage_class(location).directory(location)


def local_path(location: str | os.PathLike) -> str:
    return _local_path(os.fspath(location))


def default_aggregate_below(location: str | os.PathLike, store=None, retry: Retrying | None = None) -> int:
    """The storage's ``aggregate_below`` for a path or URL, or a zarr store object, without opening a URL: a local
    path's by its file system (file_systems.py), a store object's by its kind, any URL's the base's (object stores)."""
    if store is not None:
        return store_objects.open_store(store, as_retrying(retry)).aggregate_below
    return storage_class(location).default_aggregate_below(os.fspath(location))
