"""The layouts a state dict is held in by the ranks of a job: FSDP, HSDP and DDP."""

from __future__ import annotations

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch

__all__ = ["LAYOUTS", "in_layout"]

LAYOUTS = ("fsdp", "hsdp", "ddp")


def in_layout(layout: str, world_size: int, full: dict[str, torch.Tensor]) -> dict:
    """The state dict a rank of ``layout`` holds: "fsdp" (Shard(0) over every rank), "hsdp" ((Replicate, Shard(0)) on
    a (2, world_size / 2) mesh) or "ddp" (plain tensors, each rank a copy); scalars are replicated. Call it on every
    rank of an initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

    placements: list[Placement]
    if layout == "ddp":
        return {k: v.clone() for k, v in full.items()}
    if layout == "fsdp":
        mesh, placements = init_device_mesh("cpu", (world_size,)), [Shard(0)]
    elif layout == "hsdp":
        mesh, placements = init_device_mesh("cpu", (2, world_size // 2)), [Replicate(), Shard(0)]
    else:
        raise ValueError(f"unknown layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return {k: distribute_tensor(v, mesh, placements if v.dim() else [Replicate()] * mesh.ndim)
            for k, v in full.items()}
