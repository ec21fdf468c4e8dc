"""Random placements (tests/save_load/test_property_roundtrip.py): a rank program that saves DTensors placed one way and
loads them placed another. Here, not in the test module, so that rank processes need not import hypothesis. (The FSDP,
HSDP and DDP layouts of a state dict are dcp_zarr.testing.shardings'.)"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from tests.support.compare import assert_state_equal
from tests.support.states import random_bits

__all__ = ["full_tensor", "save_and_reload_sharded"]


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
    dcp.save(state, storage_writer=ZarrWriter(path, inner_chunk_bytes=inner_chunk_bytes))
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
