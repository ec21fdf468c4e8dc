"""The checkpoint's own description: plain JSON in the root group's ``dcp_zarr`` attribute, readable with zarr alone.

The root ``zarr.json`` is written last, after every chunk and every other ``zarr.json``: its presence with this
attribute is what makes a store a complete checkpoint. The schema is documented in README ("Store layout").
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_zarr.dtypes import torch_dtype_from_name
from dcp_zarr.errors import IncompleteCheckpointError, InvalidKeyError, MalformedMetadataError, NotACheckpointError
from dcp_zarr.layout import check_node_name
from dcp_zarr.storage import Storage

FORMAT_NAME = "dcp_zarr"
FORMAT_VERSION = 1
MANIFEST_ATTRIBUTE = "dcp_zarr"
ROOT_KEY = "zarr.json"

# Entry kinds
TENSOR = "tensor"
VALUE = "value"  # a JSON value, held inline in the manifest (see values.py)
OBJECT = "object"  # torch.save bytes in a uint8 array, loaded with weights_only=True


def read_manifest(storage: Storage) -> dict:
    """The manifest of a complete checkpoint, or an error that says what the store is instead."""
    try:
        root = storage.read_json(ROOT_KEY)
    except FileNotFoundError:
        if storage.exists("model/zarr.json") or storage.exists("optim/zarr.json"):
            raise IncompleteCheckpointError(
                f"{storage.url} is an incomplete dcp_zarr checkpoint: it has no root zarr.json, which is written "
                "last; the save was interrupted or is still running"
            ) from None
        raise NotACheckpointError(f"{storage.url} is not a dcp_zarr checkpoint: there is no zarr.json at its root") from None
    except (ValueError, RecursionError) as exc:
        raise MalformedMetadataError(f"{storage.url}: root zarr.json is not valid JSON ({exc})") from None
    if not isinstance(root, dict) or root.get("zarr_format") != 3:
        raise NotACheckpointError(f"{storage.url} is not a zarr v3 store (root zarr.json has no zarr_format 3)")
    manifest = root.get("attributes", {}).get(MANIFEST_ATTRIBUTE) if isinstance(root.get("attributes"), dict) else None
    if manifest is None:
        raise NotACheckpointError(
            f"{storage.url} is a zarr store but not a dcp_zarr checkpoint (no '{MANIFEST_ATTRIBUTE}' attribute at its root)"
        )
    _check(manifest, storage.url)
    return manifest


def _check(manifest, url: str) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise MalformedMetadataError(f"{url}: the '{MANIFEST_ATTRIBUTE}' attribute is not a dcp_zarr manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise MalformedMetadataError(
            f"{url}: dcp_zarr format version {version!r}; this dcp_zarr reads version {FORMAT_VERSION}"
        )
    if not manifest.get("complete"):
        raise IncompleteCheckpointError(f"{url}: the manifest is not marked complete")
    entries = manifest.get("entries")
    if not isinstance(entries, dict):
        raise MalformedMetadataError(f"{url}: the manifest has no 'entries' table")
    for fqn, entry in entries.items():
        if not isinstance(entry, dict) or entry.get("kind") not in (TENSOR, VALUE, OBJECT):
            raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has no valid 'kind'")
        _check_location(fqn, entry, url)
        if entry["kind"] == TENSOR:
            _check_tensor_entry(fqn, entry, url)


def _check_location(fqn: str, entry: dict, url: str) -> None:
    """The entry's state-dict path, and the node it is read from, which must be a place inside this store: a
    hostile manifest must not send the reader to ``../other.zarr`` or ``/etc``."""
    path = entry.get("path", [fqn])
    if not isinstance(path, list) or not path or any(type(part) not in (str, int) for part in path):
        raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has a malformed path {path!r}")
    if entry["kind"] == VALUE:
        return  # held in the manifest itself: its node is never read
    node = entry.get("node")
    if not isinstance(node, str):
        raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has no valid node ({node!r})")
    try:
        for name in node.split("/"):
            check_node_name(name, fqn)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"{url}: manifest entry {fqn!r} is stored at node {node!r}, which is refused: {exc}") \
            from None


def _check_tensor_entry(fqn: str, entry: dict, url: str) -> None:
    try:
        shape = entry["shape"]
        if not _is_index_list(shape):
            raise ValueError(f"shape {shape!r} is not a list of non-negative integers")
        torch_dtype_from_name(entry["dtype"])
        boxes = []
        for chunk in entry["saved_chunks"]:
            offsets, sizes = chunk["offsets"], chunk["sizes"]
            if not (_is_index_list(offsets) and _is_index_list(sizes)) or not len(offsets) == len(sizes) == len(shape):
                raise ValueError(f"saved chunk {offsets}+{sizes} is not a box of a rank-{len(shape)} tensor")
            if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
                raise ValueError(f"saved chunk {offsets}+{sizes} lies outside shape {shape}")
            boxes.append((offsets, sizes))
        if not _tiles(shape, boxes):
            raise ValueError(f"its saved chunks do not cover shape {shape} exactly once")
    except Exception as exc:  # any malformation of this entry, reported as one error naming it
        raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} is malformed: {exc}") from exc


def _is_index_list(value) -> bool:
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _tiles(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> bool:
    """Whether the boxes cover every element of ``shape`` exactly once. DCP checks this when saving; a manifest that
    breaks it would make a load silently leave part of a tensor as it was."""
    boxes = [box for box in boxes if all(box[1])]  # empty boxes (a rank with no rows) hold nothing
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(shape):
        return False
    if len(boxes) < 2:
        return True
    lo = np.array([offsets for offsets, _ in boxes], dtype=np.int64)
    hi = lo + np.array([sizes for _, sizes in boxes], dtype=np.int64)
    return not any(np.all((lo[i] < hi[i + 1:]) & (lo[i + 1:] < hi[i]), axis=1).any() for i in range(len(boxes) - 1))


def dcp_metadata(manifest: dict) -> Metadata:
    """The ``torch.distributed.checkpoint`` Metadata the saving run produced, rebuilt from JSON (no pickle)."""
    state_dict_metadata = {}
    for fqn, entry in manifest["entries"].items():
        if entry["kind"] == TENSOR:
            state_dict_metadata[fqn] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=torch_dtype_from_name(entry["dtype"]), requires_grad=bool(entry.get("requires_grad", False))
                ),
                size=torch.Size(entry["shape"]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                    for c in entry["saved_chunks"]
                ],
            )
        else:
            state_dict_metadata[fqn] = BytesStorageMetadata()
    planner_data = {fqn: tuple(entry["path"]) for fqn, entry in manifest["entries"].items() if "path" in entry}
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data or None, storage_data=None)
