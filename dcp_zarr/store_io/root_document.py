"""A checkpoint's root ``zarr.json`` read from storage: its bytes (bounded), the manifest in them, or an error that
says what the store is instead (incomplete, foreign, not a store at all)."""

from __future__ import annotations

from dcp_zarr.errors import IncompleteCheckpointError, MetadataTooLargeError, NotACheckpointError, ZarrCheckpointError
from dcp_zarr.format.manifest import (
    FORMAT_NAME,
    MANIFEST_ATTRIBUTE,
    MAX_MANIFEST_BYTES,
    ROOT_KEY,
    Manifest,
    manifest_of_root,
)
from dcp_zarr.storage import Storage

# The file torch.distributed.checkpoint's FileSystemWriter writes last, beside its .distcp files.
DCP_METADATA_FILE = ".metadata"


def read_manifest(storage: Storage) -> Manifest:
    """The manifest of a complete checkpoint, or an error that says what the store is instead."""
    return manifest_of_root(read_root(storage), storage.url)


def read_root(storage: Storage) -> bytes:
    """The root ``zarr.json``'s bytes (refused unread beyond MAX_MANIFEST_BYTES), or an error that says what the
    store is instead of a checkpoint."""
    try:
        data = storage.read_range(ROOT_KEY, 0, MAX_MANIFEST_BYTES + 1)
    except NotADirectoryError:  # a file (model.pt) where a checkpoint directory was named
        raise NotACheckpointError(f"{storage.url} is a file, not a checkpoint directory") from None
    except FileNotFoundError:
        if storage.exists("model/zarr.json") or storage.exists("optim/zarr.json") or _holds_zarr_keys(storage):
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


def _holds_zarr_keys(storage: Storage) -> bool:
    """Whether a store written in place (an object store's prefix) holds a zarr node's document or a chunk: what an
    interrupted save leaves there (its ranks write chunks first, the groups' zarr.json near the end). A directory
    is never written in place (its saves are staged and renamed), so there this is never asked."""
    if type(storage).commits_by_rename:
        return False
    try:
        keys = storage.first_keys(64)
    except NotImplementedError:
        return False
    return any(key.endswith("/zarr.json") or "/c/" in key or "/c." in key or key.endswith("/c") for key in keys)


def is_committed(storage: Storage) -> bool:
    """Whether ``storage`` holds a committed dcp_zarr checkpoint: its root zarr.json carries a manifest marked
    complete. Only that is read, not the whole manifest (a root of many steps is listed often); ``read_manifest``
    checks the rest. Never raises: anything unreadable is not committed."""
    try:
        root = storage.read_json(ROOT_KEY, max_bytes=MAX_MANIFEST_BYTES)
    except (ZarrCheckpointError, OSError, ValueError, RecursionError):
        return False
    attributes = root.get("attributes") if isinstance(root, dict) else None
    manifest = attributes.get(MANIFEST_ATTRIBUTE) if isinstance(attributes, dict) else None
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME and manifest.get("complete") is True


def holds_dcp_checkpoint(storage: Storage) -> bool:
    """Whether ``storage`` holds a torch.distributed.checkpoint checkpoint (FileSystemWriter's ``.metadata``)."""
    try:
        return storage.exists(DCP_METADATA_FILE)
    except (ZarrCheckpointError, OSError):
        return False
