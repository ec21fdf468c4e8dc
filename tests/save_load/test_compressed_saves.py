"""Compressed saves on real gloo ranks (issue 43): FSDP2 checkpoints load exactly at other world sizes, each rank
writes its own chunks, the ranks agree on which arrays compress (a sample of each rank's part decides), and every
way of saving (planned locally, planned by DCP, aggregated, to S3) compresses alike."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dcp_zarr import Compression, ZarrReader, ZarrWriter
from dcp_zarr.errors import PlanMismatchError
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.tools.verify import verify_checkpoint
from tests.support.compare import assert_state_equal
from tests.support.models import build, full_state, load_fresh, train_and_save, train_steps
from tests.support.ranks import run_ranks
from tests.support.states import random_bits

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

# The toy model's arrays are a few hundred bytes: compress every float array of them, unsampled.
EVERY_FLOAT = Compression(min_bytes=0, min_ratio=0)


def _compressed_arrays(path: str) -> dict[str, bool]:
    """fqn -> whether its array's zarr.json says blosc, for every tensor entry of at least one dimension."""
    found = {}
    ckpt = open_checkpoint(path)
    for fqn, entry in ckpt.entries.items():
        if not entry.is_tensor or not entry.shape:
            continue
        with open(os.path.join(path, entry.node, "zarr.json")) as f:
            codecs = json.load(f)["codecs"]
        inner = codecs[0]["configuration"]["codecs"] if codecs[0]["name"] == "sharding_indexed" else codecs
        found[fqn] = any(c["name"] == "blosc" for c in inner)
        assert found[fqn] == (entry.codec is not None), fqn
    return found


def _save(rank, world_size, path, options):
    writer = ZarrWriter(path, **options)
    full, _ = train_and_save(rank, world_size, "fsdp2", writer)
    return full, writer.written_keys


def _load(rank, world_size, path, options=None):
    return load_fresh(rank, world_size, "fsdp2", ZarrReader(path, **(options or {})))


@pytest.fixture(scope="module")
def compressed_fsdp2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("compressed") / "fsdp2.zarr")
    results = run_ranks(_save, 2, path, {"compression": EVERY_FLOAT, "inner_chunk_bytes": 64})
    return path, results[0][0], [keys for _, keys in results]


def test_fsdp2_compressed_loads_exactly_at_other_world_sizes(compressed_fsdp2):
    path, saved, _ = compressed_fsdp2

    for world_size in (1, 3):
        assert_state_equal(run_ranks(_load, world_size, path)[0], saved)
    # every byte read once, by one rank, and sent to the others (collective/)
    assert_state_equal(run_ranks(_load, 3, path, {"read_once": True, "read_once_below": 1 << 40})[0], saved)
    assert_state_equal(open_checkpoint(path).load_full_state_dict(), saved)
    assert verify_checkpoint(open_checkpoint(path)).ok


def test_every_float_array_is_compressed_and_every_chunk_written_by_one_rank(compressed_fsdp2):
    path, _, keys_per_rank = compressed_fsdp2

    compressed = _compressed_arrays(path)
    ckpt = open_checkpoint(path)
    floats = {f for f, e in ckpt.entries.items() if e.is_tensor and e.shape and e.dtype.is_floating_point}
    assert floats and {f for f, c in compressed.items() if c} == floats
    every = [key for keys in keys_per_rank for key in keys]
    assert len(every) == len(set(every))
    # no array-spanning shard filled at offsets (``key#i``): each rank wrote whole shards of its own
    assert not any("#" in key for key in every)
    assert all(keys for keys in keys_per_rank)


def _save_with_one_noisy_shard(rank, world_size, path, noisy_rank):
    """Two arrays sharded by rows; ``noisy``'s rows on ``noisy_rank`` are random bits (they do not compress), on
    the other ranks zeros; ``smooth`` compresses on every rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    rows = 64
    local = {"noisy": random_bits((rows, 256), torch.float32, seed=rank) if rank == noisy_rank
             else torch.zeros(rows, 256), "smooth": torch.randn(rows, 256) * 0.02}
    state = {name: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(rows * world_size, 256),
                                      stride=(256, 1)) for name, t in local.items()}
    dcp.save(state, storage_writer=ZarrWriter(path, compression="zstd"))
    return {name: t.clone() for name, t in local.items()}


@pytest.mark.parametrize("noisy_rank", [0, 1])
def test_an_array_one_rank_samples_as_incompressible_is_stored_plain_by_every_rank(tmp_path, noisy_rank):
    path = str(tmp_path / "c.zarr")

    held = run_ranks(_save_with_one_noisy_shard, 2, path, noisy_rank)

    assert _compressed_arrays(path) == {"noisy": False, "smooth": True}
    ckpt = open_checkpoint(path)
    for name in ("noisy", "smooth"):
        expected = torch.cat([held[0][name], held[1][name]])
        assert torch.equal(ckpt.read(name).view(torch.int32), expected.view(torch.int32)), name


def _save_with_options(rank, world_size, path, options_by_rank):
    try:
        _save(rank, world_size, path, options_by_rank[rank])
    except BaseException as exc:  # noqa: BLE001  (DCP wraps the error in its CheckpointException, a BaseException)
        return repr(exc)
    return None


def test_ranks_that_disagree_on_compression_are_refused_naming_the_option(tmp_path):
    path = str(tmp_path / "c.zarr")

    errors = run_ranks(_save_with_options, 2, path, [{"compression": "zstd"}, {}])

    assert errors[0] is not None and PlanMismatchError.__name__ in errors[0], errors
    assert "compression: Compression(compressor='zstd', level=1" in errors[0] and "None on rank 1" in errors[0]
    assert not os.path.exists(os.path.join(path, "zarr.json"))


class _PlansForItself(DefaultSavePlanner):
    """A planner DCP's planning is left to (it overrides create_local_plan): the save is planned by DCP."""

    def create_local_plan(self):
        return super().create_local_plan()


def _save_planned_by_dcp(rank, world_size, path):
    model, optim = build("fsdp2", world_size, 0)
    train_steps(model, optim, 2)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=ZarrWriter(path, compression=EVERY_FLOAT),
             planner=_PlansForItself())
    return full_state(model, optim)


@pytest.mark.slow
def test_a_save_dcp_plans_compresses_every_candidate_and_loads_resharded(tmp_path):
    path = str(tmp_path / "c.zarr")

    saved = run_ranks(_save_planned_by_dcp, 2, path)[0]

    assert all(_compressed_arrays(path)[f] for f, e in open_checkpoint(path).entries.items()
               if e.is_tensor and e.shape and e.dtype.is_floating_point)
    assert_state_equal(run_ranks(_load, 3, path)[0], saved)


@pytest.mark.slow
def test_aggregated_arrays_are_compressed_and_load_exactly(tmp_path):
    path = str(tmp_path / "c.zarr")

    saved = run_ranks(_save, 2, path, {"compression": EVERY_FLOAT, "aggregate_below": 1 << 40})[0][0]

    assert any(_compressed_arrays(path).values())
    assert_state_equal(run_ranks(_load, 3, path)[0], saved)
    assert verify_checkpoint(open_checkpoint(path)).ok


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.usefixtures("aws_environment")
def test_a_compressed_save_to_s3_loads_exactly(s3):
    url = f"s3://{s3.bucket}/compressed-{uuid.uuid4().hex[:8]}.zarr"
    options = s3.storage_options()
    state = {"w": (torch.randn(512, 256) * 0.02).bfloat16(), "v": torch.randn(300, 100) * 0.02}

    dcp.save(state, storage_writer=ZarrWriter(url, storage_options=options, compression="lz4"), no_dist=True)

    ckpt = open_checkpoint(url, options)
    assert ckpt.entries["w"].codec is not None and ckpt.entries["w"].codec["configuration"]["cname"] == "lz4"
    assert_state_equal(ckpt.load_full_state_dict(), state)
    assert verify_checkpoint(ckpt).ok


def _async_save_compressed(rank, world_size, path):
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    state = {"w": DTensor.from_local(full.chunk(world_size)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                     shape=full.shape, stride=full.stride())}
    future = dcp.async_save(state, storage_writer=ZarrWriter(path, compression=EVERY_FLOAT))
    state["w"].to_local().add_(1)  # the save works from its staged copy
    future.result()
    return full


def test_an_async_save_compresses_its_staged_copy(tmp_path):
    path = str(tmp_path / "c.zarr")

    full = run_ranks(_async_save_compressed, 2, path)[0]

    ckpt = open_checkpoint(path)
    assert ckpt.entries["w"].codec is not None
    assert torch.equal(ckpt.read("w"), full)
