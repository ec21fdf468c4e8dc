"""FSDP2 / HSDP / FSDP+TP checkpoints saved at one world size load bit-exactly at every other (real gloo ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import zarr

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter
from tests.support.compare import assert_state_equal
from tests.support.models import load_fresh, make_model, shard, train_and_save
from tests.support.ranks import run_ranks
from tests.support.stores import root_manifest

pytestmark = [pytest.mark.distributed]

SAVE_WORLD_SIZES = (1, 2, 3, 4)


def save_and_report(rank, world_size, layout, path):
    """Rank program: train, save, and report which chunk keys this rank wrote."""
    writer = ZarrWriter(path)
    full, shapes = train_and_save(rank, world_size, layout, writer)
    return full, shapes, writer.written_keys


def load_each(rank, world_size, layout, paths):
    return [load_fresh(rank, world_size, layout, ZarrReader(p)) for p in paths]


def chunk_files(path: str) -> set[str]:
    found = set()
    for root, _, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), path)
            if name != "zarr.json":
                found.add(rel.replace(os.sep, "/"))
    return found


@pytest.fixture(scope="module")
def fsdp2_checkpoints(tmp_path_factory):
    """One FSDP2 checkpoint per world size, with the full state rank 0 saved and each rank's chunk keys."""
    root = tmp_path_factory.mktemp("fsdp2")
    saved = {}
    for ws in SAVE_WORLD_SIZES:
        path = str(root / f"ws{ws}.zarr")
        results = run_ranks(save_and_report, ws, "fsdp2", path)
        saved[ws] = (path, results[0][0], [r[2] for r in results], [r[1] for r in results])
    return saved


@pytest.mark.slow
def test_every_chunk_is_written_by_exactly_one_rank(fsdp2_checkpoints):
    """A chunk, or an inner chunk of a shard the ranks write together (``key#i``; ``key#index`` for its index)."""
    for ws, (path, _, keys_per_rank, _) in fsdp2_checkpoints.items():
        all_keys = [k for keys in keys_per_rank for k in keys]
        assert len(all_keys) == len(set(all_keys)), f"world size {ws}: a chunk was written twice"
        files = {k.split("#")[0] for k in all_keys}
        assert files == chunk_files(path), f"world size {ws}: written keys differ from the store's files"
        for file in files:
            parts = sorted(k.split("#")[1] for k in all_keys if k.startswith(file + "#"))
            if parts:  # a shard spanning the array: every inner chunk once, and its index
                count = len(parts) - 1
                assert parts == sorted([*map(str, range(count)), "index"]), (ws, file, parts)


@pytest.mark.slow
def test_an_array_is_two_files_whatever_the_world_size(fsdp2_checkpoints):
    """Locally, an array that several ranks hold in row blocks is one shard they all write at known offsets: its
    zarr.json and one chunk file at every world size (not one per rank), each inner chunk with its crc32c."""
    for ws, (path, _, _, _) in fsdp2_checkpoints.items():
        group = zarr.open_group(path, mode="r")
        arrays = [name for name, node in group.members(max_depth=None) if isinstance(node, zarr.Array)]
        assert len(arrays) > 10
        for name in arrays:
            folder = os.path.join(path, *name.split("/"))
            chunks = [f for f in os.listdir(folder) if f != "zarr.json"]
            assert len(chunks) <= 1, f"world size {ws}: {name} has {chunks}"
        weight = group["model/embed.weight"]
        if ws > 1:
            assert weight.shards is not None and weight.shards[0] >= weight.shape[0], (ws, weight.shards)


@pytest.mark.slow
def test_every_directory_is_a_zarr_node_and_chunks_are_files_beside_its_zarr_json(fsdp2_checkpoints):
    """Chunk keys use the "." separator (c.0.1): a store has one directory per group or array, never one per chunk
    row, and each array holds its zarr.json beside its chunk files."""
    for ws, (path, _, keys_per_rank, _) in fsdp2_checkpoints.items():
        nodes = 0
        for directory, subdirectories, files in os.walk(path):
            nodes += 1
            assert "zarr.json" in files, f"world size {ws}: {directory} is a directory but not a zarr node"
            chunks = [f for f in files if f != "zarr.json"]
            assert all(f == "c" or f.startswith("c.") for f in chunks), (ws, directory, chunks)
            assert not (chunks and subdirectories), f"world size {ws}: array {directory} has subdirectories"
        written = {k.split("#")[0] for keys in keys_per_rank for k in keys}
        assert written == chunk_files(path), f"world size {ws}"
        assert nodes == len(zarr.open_group(path, mode="r").members(max_depth=None)) + 1, f"world size {ws}"


@pytest.mark.slow
def test_uneven_and_empty_shards_occur(fsdp2_checkpoints):
    """The model really exercises uneven torch.chunk splits and ranks with empty shards."""
    shapes = fsdp2_checkpoints[4][3]
    assert any(0 in s for rank_shapes in shapes for s in rank_shapes.values())
    assert len({rank_shapes["embed.weight"] for rank_shapes in shapes}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("load_ws", SAVE_WORLD_SIZES)
def test_fsdp2_loads_at_every_world_size(fsdp2_checkpoints, load_ws):
    sources = [ws for ws in SAVE_WORLD_SIZES if ws != load_ws]
    paths = [fsdp2_checkpoints[ws][0] for ws in sources]
    loaded = run_ranks(load_each, load_ws, "fsdp2", paths)[0]
    for ws, state in zip(sources, loaded):
        assert_state_equal(state, fsdp2_checkpoints[ws][1])


@pytest.mark.slow
def test_step_is_one_array_per_parameter_kept_in_its_fill_value(fsdp2_checkpoints):
    """FSDP2's step, a plain tensor on every rank, is one 0-d array per parameter whose fill_value holds it (format 7:
    no chunk), written by the coordinator, which puts it in the manifest; zarr-python reads it."""
    for ws, (path, full, _, _) in fsdp2_checkpoints.items():
        group = zarr.open_group(path, mode="r")
        state = group["optim/state"]
        params = sorted(state.group_keys())
        assert params == sorted(full["optim"]["state"]), f"world size {ws}"
        entries = root_manifest(path)["entries"]
        for name in params:
            step = state[name]["step"]
            assert step.shape == ()
            files = [f for f in chunk_files(path) if f.startswith(f"optim/state/{name}/step/")]
            assert files == [], f"world size {ws}: {files}"
            expected = full["optim"]["state"][name]["step"]
            assert torch.equal(torch.tensor(step[()]), expected)
            assert entries[f"optim.state.{name}.step"]["fill"] == expected.item()


@pytest.mark.slow
def test_zarr_reads_full_unsharded_tensors(fsdp2_checkpoints):
    path, full, _, _ = fsdp2_checkpoints[3]
    group = zarr.open_group(path, mode="r")
    for name, tensor in full["model"].items():
        stored = torch.from_numpy(group["model"][name][...])
        assert stored.shape == tensor.shape and torch.equal(stored, tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_2d_meshes_load_at_one_and_three_ranks(tmp_path, layout):
    path = str(tmp_path / f"{layout}.zarr")
    results = run_ranks(save_and_report, 4, layout, path)
    expected = results[0][0]
    all_keys = [k for r in results for k in r[2]]
    assert len(all_keys) == len(set(all_keys)), "a chunk was written twice"
    assert_state_equal(run_ranks(load_each, 1, "plain", [path])[0][0], expected)
    assert_state_equal(run_ranks(load_each, 3, "fsdp2", [path])[0][0], expected)
    manifest = zarr.open_group(path, mode="r").attrs["dcp_zarr"]
    assert manifest["saved_world_size"] == 4
    assert manifest["state_dict_type"] == "sharded"
    assert any(m["shape"] == [2, 2] for m in manifest["meshes"])


def replicated_save(rank, world_size, path):
    """Every rank holds the same plain tensors (DDP-style): DCP's deduplication must leave one writer each."""
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(9, 4), "b": torch.randn(4)},
             "optim": {"state": {"w": {"step": torch.tensor(0.0)}}}}
    writer = ZarrWriter(path)
    import torch.distributed.checkpoint as dcp

    dcp.save(state, planner=ZarrSavePlanner(), storage_writer=writer)
    return writer.written_keys, state


def test_replicated_tensors_are_written_once_by_one_rank(tmp_path):
    path = str(tmp_path / "ddp.zarr")
    results = run_ranks(replicated_save, 2, path)
    keys = [k for written, _ in results for k in written]
    assert sorted(keys) == sorted(chunk_files(path)) and len(keys) == len(set(keys))
    group = zarr.open_group(path, mode="r")
    assert torch.equal(torch.from_numpy(group["model/w"][...]), results[0][1]["model"]["w"])
    assert group["optim/state/w/step"][()] == 0.0, "a step of 0 is stored, not skipped"


def plain_model_state(seed=0):
    return {"model": make_model(seed).state_dict()}


def load_plain_into_fsdp2(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model = shard(make_model(seed=5), "fsdp2", world_size)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=ZarrReader(path))
    set_model_state_dict(model, state["model"])
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_fsdp2_model(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = shard(make_model(seed=0), "fsdp2", world_size)
    dcp.save({"model": get_model_state_dict(model)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path))


@pytest.mark.slow
def test_plain_single_process_save_loads_sharded_and_back(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    expected = plain_model_state()
    plain_path = str(tmp_path / "plain.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(expected, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(plain_path))  # no process group at all
    loaded = run_ranks(load_plain_into_fsdp2, 2, plain_path)[0]
    assert_state_equal(loaded, expected["model"])

    sharded_path = str(tmp_path / "sharded.zarr")
    run_ranks(save_fsdp2_model, 3, sharded_path)
    target = plain_model_state(seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=ZarrReader(sharded_path))  # no process group, a plain model's tensors
    assert_state_equal(target, expected)
