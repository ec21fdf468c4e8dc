"""A checkpoint root's storage: the names directly under it, the storage of each, and its small JSON documents.

Everything the lifecycle does to a root goes through this and the ``Storage`` it opens, so none of it asks which
backend holds the root: a local directory and an object-store prefix answer the same calls.
"""

from __future__ import annotations

import os

from dcp_zarr.errors import ZarrCheckpointError
from dcp_zarr.storage import Storage, as_retrying, directory_of, open_storage
from dcp_zarr.storage.retry import Retrying, RetryPolicy


class RootStorage:
    """``root`` (a local directory, made if missing, or an fsspec URL) as storage."""

    def __init__(self, root: str | os.PathLike, storage_options: dict | None = None,
                 retry: RetryPolicy | Retrying | None = None):
        self.url = os.fspath(root).rstrip("/") or "/"
        self.storage_options = storage_options
        # One Retrying for the root and every store opened under it: the lease, listing and pruning retry as the
        # manager's saves do (its writers' ``retry``)
        self.retrying = as_retrying(retry)
        # The root's directory on this machine; None for an object store's prefix.
        self.directory = directory_of(self.url)
        if self.directory is not None:
            if os.path.exists(self.directory) and not os.path.isdir(self.directory):
                raise NotADirectoryError(f"checkpoint root {self.directory} is a file, not a directory")
            os.makedirs(self.directory, exist_ok=True)
        self.storage = open_storage(self.url, storage_options, retry=self.retrying)

    def location(self, name: str) -> str:
        """The path or URL of ``name`` under the root."""
        return self.storage.location(name)

    def names(self, directory: str = "") -> list[str]:
        """The names directly under the root, or under its ``directory`` (none if it does not exist), sorted."""
        return self.storage.list_names(directory)

    def open(self, name: str, *, read_only: bool = True) -> Storage:
        """The storage of ``name`` (a store, a step folder) under the root."""
        return open_storage(self.location(name), self.storage_options, read_only=read_only, retry=self.retrying)

    def size(self, name: str) -> int:
        """Bytes stored under ``name``."""
        return self.storage.size_under(name)

    def read_json(self, key: str) -> dict | None:
        """The small document at ``key``: None if absent, ``{}`` if unreadable (torn by a crash: present, but says
        nothing)."""
        try:
            document = self.storage.read_json(key, max_bytes=1 << 16)
        except FileNotFoundError:
            return None
        except (ValueError, ZarrCheckpointError):
            return {}
        return document if isinstance(document, dict) else {}

    def write_json(self, key: str, document: dict) -> None:
        self.storage.write_json(key, document)

    def remove_key(self, key: str) -> None:
        self.storage.remove(key)

    def remove_empty_directory(self, name: str) -> None:
        """Remove the directory ``name`` if it is empty; an object store's "directories" are only key prefixes."""
        if self.directory is None:
            return
        try:
            os.rmdir(os.path.join(self.directory, name))
        except OSError:
            return  # not empty, or gone already
        # a fresh one: the old remembers it as made
        self.storage = open_storage(self.url, self.storage_options, retry=self.retrying)
