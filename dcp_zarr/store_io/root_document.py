"""A checkpoint's root ``zarr.json`` read from storage: its bytes (bounded), the manifest in them, or an error that
says what the store is instead (incomplete, foreign, not a store at all)."""

from __future__ import annotations

from dcp_zarr.errors import IncompleteCheckpointError, MetadataTooLargeError, NotACheckpointError
from dcp_zarr.format.manifest import MAX_MANIFEST_BYTES, ROOT_KEY, Manifest, manifest_of_root
from dcp_zarr.storage import Storage


def read_manifest(storage: Storage) -> Manifest:
    """The manifest of a complete checkpoint, or an error that says what the store is instead."""
    return manifest_of_root(read_root(storage), storage.url)


def read_root(storage: Storage) -> bytes:
    """The root ``zarr.json``'s bytes (refused unread beyond MAX_MANIFEST_BYTES), or an error that says what the
    store is instead of a checkpoint."""
    try:
        data = storage.read_range(ROOT_KEY, 0, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        if storage.exists("model/zarr.json") or storage.exists("optim/zarr.json"):
            raise IncompleteCheckpointError(
                f"{storage.url} is an incomplete dcp_zarr checkpoint: it has no root zarr.json, which is written "
                "last; the save was interrupted or is still running"
            ) from None
        raise NotACheckpointError(
            f"{storage.url} is not a dcp_zarr checkpoint: there is no zarr.json at its root") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise MetadataTooLargeError(f"{storage.url}/{ROOT_KEY} is larger than {MAX_MANIFEST_BYTES} bytes; refused "
                                    "unread")
    return data
