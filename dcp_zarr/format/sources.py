"""What kind of object each saved tensor was (DTensor and its placements, ShardedTensor, plain tensor)."""

from __future__ import annotations

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.tensor import DTensor

DTENSOR = "dtensor"
SHARDED_TENSOR = "sharded_tensor"
PLAIN_TENSOR = "tensor"


def describe_source(value, sharded_tensor_type: type | None) -> dict:
    """JSON description of a state-dict value as the saving rank held it. ``sharded_tensor_type``: torch's
    ``ShardedTensor`` (a private module's, so planning/dcp_internals.py passes it in), None where torch has none."""
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        return {
            "type": DTENSOR,
            "placements": [str(p) for p in value.placements],
            "mesh_shape": list(mesh.shape),
            "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        }
    if sharded_tensor_type is not None and isinstance(value, sharded_tensor_type):
        return {"type": SHARDED_TENSOR}
    if isinstance(value, torch.Tensor):
        return {"type": PLAIN_TENSOR}
    return {"type": "unknown"}


class SourceDescriptions:
    """``describe_source`` once per kind of holder: the thousands of DTensors of one model share a mesh and
    placements, so they share one description, which each rank's results then pickle once."""

    def __init__(self, sharded_tensor_type: type | None) -> None:
        self._known: dict = {}
        self._sharded_tensor_type = sharded_tensor_type

    def __call__(self, value) -> dict:
        if isinstance(value, DTensor):
            key: tuple = (DTENSOR, value.placements, value.device_mesh)
        else:
            key = (type(value),)
        try:
            return self._known[key]
        except KeyError:
            description = self._known[key] = describe_source(value, self._sharded_tensor_type)
            return description
        except TypeError:  # an unhashable placement or mesh: describe it alone
            return describe_source(value, self._sharded_tensor_type)


def summarize_sources(sources: list[dict]) -> dict:
    """The checkpoint's state_dict_type and the device meshes its DTensors lived on."""
    meshes = []
    for source in sources:
        if source.get("type") == DTENSOR:
            mesh = {"shape": source["mesh_shape"], "dim_names": source["mesh_dim_names"]}
            if mesh not in meshes:
                meshes.append(mesh)
    sharded = any(s.get("type") in (DTENSOR, SHARDED_TENSOR) for s in sources)
    return {"state_dict_type": "sharded" if sharded else "full", "meshes": meshes}
