"""Aggregated writes (collective/): arrays held in small pieces are written by one aggregator rank per block, as one
zarr chunk each, read back bit-exact by any world size and by zarr-python; an aggregator that fails fails the save
on every rank, and the previous checkpoint stays as it was (real gloo ranks)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter, open_checkpoint
from dcp_zarr.collective import aggregated_writes
from dcp_zarr.collective.aggregation import aggregated_layout
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.storage.file_systems import file_system_type, is_shared
from tests.support.compare import assert_state_equal
from tests.support.faults import causes
from tests.support.models import build, full_state, load_fresh, save_checkpoint, train_steps
from tests.support.ranks import run_ranks

ALWAYS = 1 << 40  # aggregate_below: every array held in pieces is aggregated


def save_aggregated(rank, world_size, layout, path, options):
    model, optim = build(layout, world_size)
    train_steps(model, optim, 2)
    writer = ZarrWriter(path, **options)
    save_checkpoint(model, optim, writer, planner=ZarrSavePlanner())
    return full_state(model, optim), writer.written_keys


def chunk_files(path: str) -> dict[str, list[str]]:
    """node -> its chunk files, for every array of the store."""
    found = {}
    for directory, _, files in os.walk(path):
        if "zarr.json" in files and directory != path:
            chunks = sorted(f for f in files if f.startswith("c"))
            if chunks:
                found[os.path.relpath(directory, path)] = chunks
    return found


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout, world_size", [("fsdp2", 4), ("fsdp2", 3), ("hsdp", 4), ("fsdp_tp", 4)])
def test_small_pieces_are_written_once_per_array_by_an_aggregator_and_load_back_at_any_world_size(
        tmp_path, layout, world_size):
    path = str(tmp_path / "ckpt.zarr")
    results = run_ranks(save_aggregated, world_size, layout, path, {"aggregate_below": ALWAYS})
    saved = results[0][0]
    keys = [k for _, written in results for k in written]
    assert len(keys) == len(set(keys)), "a chunk was written by two ranks"
    ckpt = open_checkpoint(path)
    sharded = [e for e in ckpt.manifest.entries.values() if getattr(e, "saved_shards", 1) > 1]
    assert sharded, "the layout holds no array in pieces"
    files = chunk_files(path)
    for entry in sharded:  # the toy model's arrays are smaller than an inner chunk: one chunk each
        assert files[entry.node] == ["c" + ".0" * len(entry.shape)], (entry.fqn, files[entry.node])
    loaded = run_ranks(load_fresh, 2, "fsdp2", ZarrReader(path))[0]
    assert_state_equal(loaded, saved)
    group = zarr.open_group(path, mode="r")
    for entry in sharded:  # zarr-python, without dcp_zarr, reads what was saved
        expected = saved
        for part in entry.path:
            expected = expected[part]
        assert np.array_equal(group[entry.node][...], expected.numpy()), entry.fqn


def save_large(rank, world_size, path, options):
    mesh = init_device_mesh("cpu", (world_size,))
    full = {"w": torch.arange(50 * 33, dtype=torch.float32).reshape(50, 33),
            "b": torch.arange(7, dtype=torch.float64), "h": torch.arange(41 * 5).reshape(41, 5).to(torch.bfloat16)}
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save(state, storage_writer=ZarrWriter(path, **options), planner=ZarrSavePlanner())
    return full


@pytest.mark.slow
@pytest.mark.distributed
def test_an_array_larger_than_the_exchange_budget_is_written_in_blocks_over_several_rounds(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    options = {"aggregate_below": ALWAYS, "exchange_bytes": 2000, "inner_chunk_bytes": 500}
    full = run_ranks(save_large, 3, path, options)[0]
    ckpt = open_checkpoint(path)
    w = ckpt.manifest.entries["w"]
    layout = aggregated_layout((50, 33), 4, 500, 2000)
    assert (w.chunk_shape, w.inner_chunk_rows) == (layout.chunk_shape, layout.inner_rows) == ((15, 33), 3)
    assert chunk_files(path)["w"] == [f"c.{i}.0" for i in range(4)]  # 50 rows in blocks of 15
    assert_state_equal(ckpt.load_full_state_dict(), full)
    group = zarr.open_group(path, mode="r")
    assert np.array_equal(group["w"][...], full["w"].numpy())
    for world_size in (1, 2):
        target = run_ranks(load_sharded_large, world_size, path)[0]
        assert_state_equal(target, full)


def load_sharded_large(rank, world_size, path):
    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(torch.zeros(50, 33), mesh, [Shard(0)]),
             "b": distribute_tensor(torch.zeros(7, dtype=torch.float64), mesh, [Shard(0)]),
             "h": distribute_tensor(torch.zeros(41, 5, dtype=torch.bfloat16), mesh, [Shard(0)])}
    dcp.load(state, storage_reader=ZarrReader(path))
    return {k: v.full_tensor() for k, v in state.items()}


def test_aggregated_layouts_are_row_blocks_of_whole_inner_chunks():
    assert aggregated_layout((10, 4), 4, 1 << 20, 256 << 20) == ChunkLayout((10, 4), (10, 4), 0)  # one small chunk
    big = aggregated_layout((1000, 256), 4, 1 << 20, 256 << 20)  # 1 MB: 1 MiB inner chunks of 1024 rows: one
    assert big == ChunkLayout((1000, 256), (1000, 256), 0)
    blocks = aggregated_layout((10000, 256), 4, 1 << 20, 4 << 20)  # 10 MB in blocks of 4 inner chunks
    assert blocks.chunk_shape == (4096, 256) and blocks.inner_rows == 1024 and blocks.grid_shape == (3, 1)
    one = aggregated_layout((3000, 256), 4, 1 << 20, 256 << 20)  # one block, padded to whole inner chunks
    assert one.chunk_shape == (3072, 256) and one.inner_rows == 1024
    assert aggregated_layout((), 4, 1 << 20, 1 << 20) == ChunkLayout((), (), 0)


@pytest.mark.slow
@pytest.mark.distributed
def test_pieces_at_or_above_the_threshold_are_written_by_their_own_ranks(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    results = run_ranks(save_aggregated, 2, "fsdp2", path, {"aggregate_below": 0})
    files = chunk_files(path)
    embed = open_checkpoint(path).manifest.entries["model.embed.weight"]
    assert embed.inner_chunk_rows, "not the array-spanning shard that both ranks fill"
    assert files[embed.node] == ["c.0.0"]
    by_rank = [[k for k in written if k.startswith(embed.node + "/")] for _, written in results]
    assert all(by_rank), by_rank  # both ranks wrote inner chunks of it


def test_file_systems_shared_over_a_network_are_told_from_local_ones(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nfs:/lustre /scratch lustre rw 0 0\n"
                      "srv:/home /home/shared nfs4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n")
    file_system_type.cache_clear()
    assert file_system_type("/scratch/run/ckpt.zarr", str(mounts)) == "lustre"
    assert is_shared("/scratch/run", str(mounts)) and is_shared("/home/shared/x", str(mounts))
    assert not is_shared("/home/sharedx/y", str(mounts)) and not is_shared("/dev/shm/x", str(mounts))
    assert file_system_type("/tmp/x", str(tmp_path / "absent")) is None


def save_over_a_checkpoint(world_size, path, writer: ZarrWriter, before=None) -> list[str] | None:
    """A good save of "w", then ``before()`` and a save of other values with ``writer``: its causes if it failed."""
    mesh = init_device_mesh("cpu", (world_size,))
    good = {"w": distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])}
    dcp.save(good, storage_writer=ZarrWriter(path, aggregate_below=ALWAYS), planner=ZarrSavePlanner())
    if before is not None:
        before()
    bad = {"w": distribute_tensor(torch.full((8, 3), -1.0), mesh, [Shard(0)])}
    try:
        dcp.save(bad, storage_writer=writer, planner=ZarrSavePlanner())
    except CheckpointException as exc:
        return [f"{type(c).__name__}: {c}" for c in causes(exc)]
    return None


def save_failing(rank, world_size, path, fail_on):
    """Rank program: a good save, then one with overwrite=True whose aggregator ``fail_on`` cannot write."""
    def break_the_writes():
        def failing(storage, key, data, layout):
            raise OSError(28, f"No space left on device (injected, writing {key})")
        aggregated_writes.write_chunk = failing

    return save_over_a_checkpoint(world_size, path, ZarrWriter(path, aggregate_below=ALWAYS, overwrite=True),
                                  break_the_writes if rank == fail_on else None)


@pytest.mark.slow
@pytest.mark.distributed
def test_an_aggregator_that_fails_to_write_fails_the_save_on_every_rank_and_the_old_checkpoint_stays(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    owner = _aggregator_of_w(3)
    results = run_ranks(save_failing, 3, path, owner)
    assert all(results), results
    for messages in results:  # every rank sees every rank's cause: the aggregator's own, the others naming it
        text = "\n".join(messages)
        assert "No space left on device (injected, writing w/c.0.0)" in text, text
        assert f"rank {owner} of the process group failed" in text, text
    target = {"w": torch.zeros(8, 3)}
    dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(24.0).reshape(8, 3))
    assert os.listdir(tmp_path) == ["ckpt.zarr"] or all(
        not name.startswith(".ckpt.zarr") or "partial" in name for name in os.listdir(tmp_path))


def save_with_options_that_differ(rank, world_size, path):
    """Rank program: a checkpoint, then a save over it whose rank 0 would not aggregate while the others would."""
    below = 0 if rank == 0 else ALWAYS
    return save_over_a_checkpoint(world_size, path, ZarrWriter(path, aggregate_below=below, overwrite=True))


@pytest.mark.slow
@pytest.mark.distributed
def test_writers_whose_options_differ_across_ranks_are_refused_before_anything_is_written(tmp_path):
    # Ranks that decide aggregation apart (aggregate_below's default follows each rank's view of the mount) would
    # write different layouts: some pieces twice, others never.
    path = str(tmp_path / "ckpt.zarr")
    results = run_ranks(save_with_options_that_differ, 3, path)
    for messages in results:
        text = "\n".join(messages)
        assert "PlanMismatchError" in text and f"aggregate_below: 0 on rank 0; {ALWAYS} on ranks 1, 2" in text, text
        assert "exchange_bytes" not in text, text
    target = {"w": torch.zeros(8, 3)}
    dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(24.0).reshape(8, 3))


def _aggregator_of_w(world_size: int) -> int:
    from dcp_zarr.collective.aggregation import plan_aggregation
    from dcp_zarr.placement.holdings import DTENSOR, Holding, Mesh, MeshSlice

    mesh = MeshSlice.of_root(Mesh.of((world_size,), range(world_size)))
    entry = Holding("w", ("w",), "tensor", torch.float32, (8, 3), False, DTENSOR, mesh, (Shard(0),))
    return plan_aggregation({"w": entry}, world_size, ALWAYS, 1 << 20, 256 << 20).arrays["w"].aggregators[0]


def save_differing_keys(rank, world_size, path):
    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(torch.arange(30.0).reshape(10, 3), mesh, [Shard(0)])}
    if rank == 1:
        state["only_on_1"] = torch.full((3,), 7.0)
    dcp.save(state, storage_writer=ZarrWriter(path, aggregate_below=ALWAYS), planner=ZarrSavePlanner())


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_that_differ_are_aggregated_after_their_exchange(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    run_ranks(save_differing_keys, 3, path)
    assert chunk_files(path)["w"] == ["c.0.0"]
    target = {"w": torch.zeros(10, 3), "only_on_1": torch.zeros(3)}
    dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(30.0).reshape(10, 3))
    assert torch.equal(target["only_on_1"], torch.full((3,), 7.0))


def test_collective_io_options_are_checked():
    with pytest.raises(ValueError, match="aggregate_below=-1"):
        ZarrWriter("x", aggregate_below=-1)
    with pytest.raises(ValueError, match="exchange_bytes=0"):
        ZarrWriter("x", exchange_bytes=0)
    with pytest.raises(ValueError, match="read_once_below='1'"):
        ZarrReader("x", read_once_below="1")
    with pytest.raises(ValueError, match="exchange_bytes=-4"):
        ZarrReader("x", exchange_bytes=-4)
    with pytest.raises(ValueError, match="read_once='false'"):
        ZarrReader("x", read_once="false")
    assert ZarrReader("x", read_once=False).settings.read_once is False


def async_aggregated(rank, world_size, path, executor):
    """Rank program: dcp.async_save with every array aggregated. The thread executor saves on a gloo group of its
    own, as CheckpointManager does, while training goes on (a collective on the default group); the process executor
    saves in its own process, on that process's default group."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    state = {"w": distribute_tensor(full.clone(), mesh, [Shard(0)])}
    writer = ZarrWriter(path, aggregate_below=ALWAYS)
    if executor == "thread":
        group = dist.new_group(backend="gloo")
        future = dcp.async_save(state, storage_writer=writer, planner=ZarrSavePlanner(process_group=group),
                                process_group=group, async_checkpointer_type=AsyncCheckpointerType.THREAD)
    else:
        future = dcp.async_save(state, storage_writer=writer, planner=ZarrSavePlanner(),
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    state["w"].to_local().add_(1)  # the save works from its staged copy
    if executor == "thread":
        dist.all_reduce(torch.ones(1))  # the training's own collective, meanwhile
    future.result()
    return full


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_an_async_save_aggregates_on_the_background_saves_own_group(tmp_path, executor):
    path = str(tmp_path / "ckpt.zarr")
    full = run_ranks(async_aggregated, 2, path, executor)[0]
    assert chunk_files(path)["w"] == ["c.0.0"]
    target = {"w": torch.zeros(40, 6)}
    dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
    assert torch.equal(target["w"], full)


def save_on_a_subgroup(rank, world_size, path):
    """Rank program: ranks 1 and 2 of 3 save a DTensor on their own mesh and group; rank 0 only makes the mesh (its
    group is made collectively). The exchange addresses ranks by the group's numbering."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [1, 2])
    if rank == 0:
        return None
    full = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)])}
    group = mesh.get_group()
    dcp.save(state, storage_writer=ZarrWriter(path, aggregate_below=ALWAYS),
             planner=ZarrSavePlanner(process_group=group), process_group=group)
    return full


@pytest.mark.slow
@pytest.mark.distributed
def test_a_save_on_a_subgroup_aggregates_among_its_own_ranks(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    full = run_ranks(save_on_a_subgroup, 3, path)[1]
    assert chunk_files(path)["w"] == ["c.0.0"]
    target = {"w": torch.zeros(12, 5)}
    dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
    assert torch.equal(target["w"], full)
