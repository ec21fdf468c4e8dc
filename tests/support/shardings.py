"""Shardings of test states: the FSDP, HSDP and DDP layouts of a state dict (the collective I/O tests), and random
shardings (tests/test_property_roundtrip.py): a rank program that saves DTensors placed one way and loads them
placed another. Here, not in the test modules, so that rank processes need not import hypothesis."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import ZarrSavePlanner
from tests.support.compare import assert_state_equal
from tests.support.states import random_bits

__all__ = ["full_tensor", "in_layout", "save_and_reload_sharded"]


def in_layout(layout: str, world_size: int, full: dict[str, torch.Tensor]) -> dict:
    """The state dict a rank of ``layout`` holds: "fsdp" (Shard(0) over every rank), "hsdp" ((Replicate, Shard(0)) on
    a (2, world_size / 2) mesh) or "ddp" (plain tensors, each rank a copy); scalars are replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if layout == "ddp":
        return {k: v.clone() for k, v in full.items()}
    if layout == "fsdp":
        mesh, placements = init_device_mesh("cpu", (world_size,)), [Shard(0)]
    else:
        mesh, placements = init_device_mesh("cpu", (2, world_size // 2)), [Replicate(), Shard(0)]
    return {k: distribute_tensor(v, mesh, placements if v.dim() else [Replicate()] * mesh.ndim)
            for k, v in full.items()}


def full_tensor(spec: dict) -> torch.Tensor:
    """The whole tensor a spec ({"shape", "dtype", "seed", "save", "load"}) describes."""
    return random_bits(spec["shape"], spec["dtype"], torch.Generator().manual_seed(spec["seed"]))


def _placed(full: torch.Tensor, mesh, codes):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = [Replicate() if c == "R" else Shard(int(c[1:])) for c in codes]
    return distribute_tensor(full, mesh, placements, src_data_rank=None)  # every rank cuts its own piece: no comms


def save_and_reload_sharded(rank: int, world_size: int, path: str, mesh_shape, specs, inner_chunk_bytes):
    """Rank program: save the specs' tensors as DTensors placed as ``spec["save"]`` ("R" or "S<dim>" per mesh dim),
    load them back placed as ``spec["load"]``, and compare each rank's local piece bit-exact."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_zarr import ZarrReader, ZarrWriter

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    state = {"model": {s["name"]: _placed(full_tensor(s), mesh, s["save"]) for s in specs}, "step": 7}
    dcp.save(state, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path, inner_chunk_bytes=inner_chunk_bytes))
    target = {"model": {}, "step": None}
    for s in specs:
        blank = torch.empty(s["shape"], dtype=s["dtype"])
        if blank.numel() and s["dtype"] != torch.bool:
            blank.view(-1).view(torch.uint8).fill_(0x5A)
        target["model"][s["name"]] = _placed(blank, mesh, s["load"])
    dcp.load(target, storage_reader=ZarrReader(path))
    assert target["step"] == 7
    for s in specs:
        expected = _placed(full_tensor(s), mesh, s["load"]).to_local()
        assert_state_equal(target["model"][s["name"]].to_local(), expected)
    return True
