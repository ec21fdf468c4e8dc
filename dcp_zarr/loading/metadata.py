"""DCP's Metadata for a load, rebuilt from a store's manifest (JSON, no pickle)."""

from __future__ import annotations

import dataclasses
from typing import Any

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_zarr.format.manifest import Manifest, TensorEntry
from dcp_zarr.format.torch_arrays import torch_dtype_from_name

# Key of the manifest in ``Metadata.storage_data``: ZarrLoadPlanner reads the optimizer param tables from it.
MANIFEST_IN_STORAGE_DATA = "dcp_zarr_manifest"
# torch 2.15's TensorProperties hold the strides of the tensor a chunk was saved from; earlier ones have no field.
_PROPERTIES_HOLD_STRIDES = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}


def dcp_metadata(manifest: Manifest) -> Metadata:
    """DCP's Metadata for a load.

    Each tensor is presented as one chunk, the global array: DCP's planner then gives every rank one read item per
    local shard, whatever world size saved it, and ``read_data`` maps each item's region onto the zarr chunks (and
    inner chunks) under it. Listing the saved boxes instead would make every rank's plan O(saving ranks x tensors).
    """
    state_dict_metadata: dict = {}
    for fqn, entry in manifest.entries.items():
        if isinstance(entry, TensorEntry):
            shape = torch.Size(entry.shape)
            state_dict_metadata[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype_from_name(entry.dtype),
                                            requires_grad=entry.requires_grad, **_strides(shape)),
                size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
            )
        else:
            state_dict_metadata[fqn] = BytesStorageMetadata()
    planner_data = {fqn: entry.path for fqn, entry in manifest.entries.items()}
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data or None, storage_data=None)


def _strides(shape: torch.Size) -> dict[str, Any]:
    """``strides=`` where torch's TensorProperties have them: the one chunk presented is the array at its global shape,
    in C order, so ``torch.empty(shape).stride()``, which DCP's own metadata holds for a contiguous tensor saved whole.
    (For a sharded one, DCP's holds the strides of the first saving rank's local shard: a store does not record how
    the saving ranks held their tensors, nor does what a load reads depend on it.)"""
    if not _PROPERTIES_HOLD_STRIDES:
        return {}
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)  # torch's rule: a dimension of size 0 strides as one of size 1
    return {"strides": tuple(reversed(strides))}
