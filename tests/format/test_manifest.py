"""The manifest (format 2): typed and checked in linear time, O(tensors) whatever the saving world size, one chunk
per tensor for DCP's load planning; format-1 stores (tests/data, written by the format-1 writer) keep loading."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_zarr import (
    MalformedMetadataError,
    MetadataTooLargeError,
    ZarrReader,
    ZarrSavePlanner,
    ZarrWriter,
    open_checkpoint,
)
from dcp_zarr.format.manifest import FORMAT_VERSION, Manifest, TensorEntry
from dcp_zarr.store_io import root_document
from dcp_zarr.tools.cli import main as dcp_zarr_cli
from tests.support.compare import assert_state_equal
from tests.support.models import build, load_fresh, train_and_save
from tests.support.ranks import run_ranks
from tests.support.stores import edit_root_manifest, root_manifest

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
FORMAT1 = os.path.join(DATA, "format1-fsdp2-3ranks")  # tests/data/make_format1.py, at format 1
FORMAT2 = os.path.join(DATA, "format2-fsdp2-3ranks")  # tests/data/make_format2.py, at format 2


@pytest.fixture(scope="module")
def saved_at(tmp_path_factory):
    """world size -> (store of a 2-step FSDP2 ToyModel with AdamW saved at that world size, its full state)."""
    root = tmp_path_factory.mktemp("saved")
    stores = {}
    for world_size in (1, 4):
        path = str(root / f"ws{world_size}.zarr")
        stores[world_size] = (path, run_ranks(train_and_save, world_size, "fsdp2", ZarrWriter(path))[0][0])
    return stores


# -- format 2 ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_manifest_records_grids_not_boxes_and_does_not_grow_with_the_saving_world_size(saved_at):
    manifests = {ws: root_manifest(path) for ws, (path, _) in saved_at.items()}
    sizes = {ws: len(json.dumps({k: v for k, v in manifest.items() if k != "nodes"}))
             for ws, manifest in manifests.items()}
    for manifest in manifests.values():
        assert manifest["format_version"] == FORMAT_VERSION == 7
        assert not any("saved_chunks" in entry for entry in manifest["entries"].values())
    assert manifests[4]["entries"]["model.embed.weight"]["saved_shards"] == 4
    assert sizes[4] <= 1.01 * sizes[1], sizes
    # the nodes' copies are one zarr.json per node, whatever the world size (a shard spanning an array at 4 ranks has
    # a longer codec list than the one chunk at 1: a constant per array)
    nodes = {ws: set(manifest["nodes"]) for ws, manifest in manifests.items()}
    assert nodes[4] == nodes[1] and len(nodes[1]) > 10


@pytest.mark.slow
@pytest.mark.distributed
def test_reader_presents_each_tensor_as_one_chunk_the_global_array(saved_at):
    metadata = ZarrReader(saved_at[4][0]).read_metadata()
    tensors = {fqn: md for fqn, md in metadata.state_dict_metadata.items() if hasattr(md, "chunks")}
    assert tensors
    for md in tensors.values():
        assert [(list(c.offsets), list(c.sizes)) for c in md.chunks] == [([0] * len(md.size), list(md.size))]


def test_the_readers_tensor_properties_are_dcps_for_tensors_saved_whole(tmp_path):
    """What DCP's own reader holds of each tensor saved whole from a contiguous tensor (dtype, requires_grad, and from
    torch 2.15 strides: torch.empty(shape).stride()), the reader's one chunk, the global array, holds too."""
    state = {"w": torch.ones(3, 5), "grad": torch.ones(4, requires_grad=True), "scalar": torch.tensor(2.0),
             "empty": torch.ones(0, 3), "empty_last": torch.ones(3, 0, 2), "bf16": torch.ones(2, 3, 4).bfloat16()}
    dcp.save(state, storage_writer=ZarrWriter(str(tmp_path / "z.zarr")))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")))
    ours = ZarrReader(str(tmp_path / "z.zarr")).read_metadata().state_dict_metadata
    dcps = dcp.FileSystemReader(str(tmp_path / "fs")).read_metadata().state_dict_metadata
    assert {fqn: ours[fqn].properties for fqn in state} == {fqn: dcps[fqn].properties for fqn in state}
    if hasattr(dcps["w"].properties, "strides"):  # torch 2.15
        assert [ours[fqn].properties.strides for fqn in state] == [t.stride() for t in state.values()]


def _read_items_per_key(rank: int, world_size: int, path: str) -> dict[str, int]:
    model, optim = build("fsdp2", world_size, seed=1)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, ZarrReader(path).read_metadata(), rank == 0)
    return dict(Counter(item.dest_index.fqn for item in planner.create_local_plan().items))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_ranks_load_plan_has_one_read_item_per_local_shard_however_many_ranks_saved(saved_at):
    for counts in run_ranks(_read_items_per_key, 2, saved_at[4][0]):
        assert counts and set(counts.values()) == {1}, counts


@pytest.mark.slow
@pytest.mark.distributed
def test_store_saved_at_4_ranks_loads_at_2_and_1(saved_at):
    path, expected = saved_at[4]
    for world_size in (2, 1):
        assert_state_equal(run_ranks(load_fresh, world_size, "fsdp2", ZarrReader(path))[0], expected)


@pytest.mark.slow
@pytest.mark.distributed
def test_manifest_round_trips_through_json(saved_at):
    manifest = ZarrReader(saved_at[4][0]).read_metadata().storage_data["dcp_zarr_manifest"]
    assert isinstance(manifest, Manifest)
    assert Manifest.from_json(manifest.to_json(), "x") == manifest
    stored = root_manifest(saved_at[4][0])
    assert set(stored.pop("nodes")) == set(manifest.node_documents)  # the copies: added by the commit, read apart
    assert json.loads(json.dumps(manifest.to_json())) == stored


# -- format 1 ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_format1_store_loads_resharded_into_fsdp2():
    expected = torch.load(os.path.join(DATA, "format1-expected.pt"), weights_only=True)
    for world_size in (2, 1):
        assert_state_equal(run_ranks(load_fresh, world_size, "fsdp2", ZarrReader(FORMAT1))[0], expected)


def test_format1_store_reads_offline_and_verifies(capsys):
    ckpt = open_checkpoint(FORMAT1)
    assert ckpt.manifest.format_version == 1 and ckpt.saved_world_size == 3
    embed = ckpt.entries["model.embed.weight"]
    assert embed.saved_shards == 3 and embed.chunk_shape == (6, 13)
    extra = ckpt.load_full_state_dict(prefix=["extra"])["extra"]
    assert extra["step"] == 7 and extra["shape"] == torch.Size([3, 4])
    assert torch.equal(extra["scale"], torch.arange(5.0))
    state = {"extra": {"step": 0, "scale": torch.zeros(5)}}
    dcp.load(state, storage_reader=ZarrReader(FORMAT1))
    assert state["extra"]["step"] == 7 and torch.equal(state["extra"]["scale"], torch.arange(5.0))
    assert dcp_zarr_cli(["verify", "--no-progress", FORMAT1]) == 0
    capsys.readouterr()


# -- format 2: chunk keys with "/" -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_format2_store_with_slash_chunk_keys_loads_resharded_reads_offline_and_verifies(capsys):
    """tests/data/make_format2.py, at format 2: chunks at c/0/0, the torch.save value at c/0."""
    assert os.path.isfile(os.path.join(FORMAT2, "model", "embed.weight", "c", "0", "0"))
    expected = torch.load(os.path.join(DATA, "format2-expected.pt"), weights_only=True)
    for world_size in (2, 1):
        assert_state_equal(run_ranks(load_fresh, world_size, "fsdp2", ZarrReader(FORMAT2))[0], expected)
    ckpt = open_checkpoint(FORMAT2)
    assert ckpt.manifest.format_version == 2
    extra = ckpt.load_full_state_dict(prefix=["extra"])["extra"]
    assert extra["step"] == 7 and extra["shape"] == torch.Size([3, 4])  # a torch.save value: key c/0
    assert dcp_zarr_cli(["verify", "--no-progress", FORMAT2]) == 0
    capsys.readouterr()


E = "model.embed.weight"  # (17, 13), saved by 3 ranks as rows 0-6, 6-12, 12-17


def _boxes(*rows: tuple[int, int]) -> list[dict]:
    return [{"offsets": [start, 0], "sizes": [stop - start, 13]} for start, stop in rows]


@pytest.mark.parametrize("boxes, text", [
    (_boxes((0, 6), (6, 12), (12, 18)), "outside shape"),
    (_boxes((0, 6), (6, 12)), "hold 156 elements"),
    ("0:17", "not a list"),
    ([{"offsets": [0], "sizes": [17]}], "rank-2"),
    ([{"offsets": [0, 0], "sizes": [17, -13]}], "non-negative"),
], ids=["outside the shape", "a gap", "not a list", "box of another rank", "negative size"])
def test_format1_boxes_that_cannot_be_the_saved_shards_are_refused_naming_the_entry(tmp_path, boxes, text):
    path = str(tmp_path / "ckpt")
    shutil.copytree(FORMAT1, path)
    edit_root_manifest(path, lambda m: m["entries"][E].update(saved_chunks=boxes))
    with pytest.raises(MalformedMetadataError, match=text) as caught:
        ZarrReader(path).read_metadata()
    assert repr(E) in str(caught.value) and "zarr.json" in str(caught.value)


def test_format1_entry_without_boxes_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(FORMAT1, path)
    edit_root_manifest(path, lambda m: m["entries"][E].pop("saved_chunks"))
    with pytest.raises(MalformedMetadataError, match="saved_chunks"):
        ZarrReader(path).read_metadata()


def test_many_format1_boxes_are_checked_and_counted():
    rows = 200_000
    entry = {"path": ["w"], "kind": "tensor", "node": "w", "dtype": "torch.float32", "shape": [rows, 2],
             "chunk_shape": [1, 2], "saved_chunks": [{"offsets": [i, 0], "sizes": [1, 2]} for i in range(rows)]}
    document = {"format": "dcp_zarr", "format_version": 1, "complete": True, "entries": {"w": entry}}
    parsed = Manifest.from_json(document, "mem")
    assert isinstance(parsed.entries["w"], TensorEntry) and parsed.entries["w"].saved_shards == rows


# -- size limit ----------------------------------------------------------------------------------------------------


def test_oversized_manifest_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    shutil.copytree(FORMAT1, path)
    size = os.path.getsize(os.path.join(path, "zarr.json"))
    monkeypatch.setattr(root_document, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(MetadataTooLargeError, match="zarr.json is larger than"):
        ZarrReader(path).read_metadata()
    monkeypatch.setattr(root_document, "MAX_MANIFEST_BYTES", size)
    assert ZarrReader(path).read_metadata().state_dict_metadata


def _save_rows(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(100 * 1024, dtype=torch.float32).reshape(100, 1024)
    # 25-row shards of 1-row inner chunks: a shard is 25 inner chunks, as a 25 MiB shard is of 1 MiB ones
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)},
             storage_writer=ZarrWriter(path, inner_chunk_bytes=4096), planner=ZarrSavePlanner())


def _load_rows(rank: int, world_size: int, path: str) -> tuple[int, int, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(100 * 1024, dtype=torch.float32).reshape(100, 1024)
    state = {"w": distribute_tensor(torch.zeros(100, 1024), mesh, [Shard(0)], src_data_rank=None)}
    reader = ZarrReader(path)
    dcp.load(state, storage_reader=reader)
    local = state["w"].to_local()
    start = rank * -(-100 // world_size)
    return reader.bytes_read, local.numel() * 4, torch.equal(local, full[start: start + local.shape[0]])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_resharded_load_reads_at_most_a_tenth_more_than_it_needs(tmp_path):
    path = str(tmp_path / "rows.zarr")
    run_ranks(_save_rows, 4, path)
    for read, needed, equal in run_ranks(_load_rows, 3, path):
        assert equal and needed <= read <= 1.1 * needed, (read, needed)


@pytest.mark.parametrize("paths, why", [
    ({"a": ["m", "w"], "b": ["m", "w", "x"]}, "inside another entry's value"),
    ({"a": ["m", 0], "b": ["m", "w"]}, "both by names and by list positions"),
    ({"a": ["m", -1]}, "list position -1"),
    ({"a": ["m", 10**12]}, "list position 1000000000000"),
    ({"a": ["m", 1 << 24]}, f"list position {1 << 24}"),
    ({"a": ["m", "w"], "b": ["m", "w"]}, "which another entry also uses"),
])
def test_entry_paths_that_cannot_form_one_state_dict_are_refused(paths, why):
    entries = {fqn: {"path": path, "kind": "value", "node": f"n{i}", "value": 1}
               for i, (fqn, path) in enumerate(paths.items())}
    document = {"format": "dcp_zarr", "format_version": 4, "complete": True, "entries": entries}

    with pytest.raises(MalformedMetadataError, match=re.escape(why)):
        Manifest.from_json(document, "mem://x")


@pytest.mark.slow
@pytest.mark.distributed
def test_reading_a_manifest_keeps_no_decoded_copies_and_leaves_the_collector_as_it_was(saved_at):
    """The root's thousands of decoded containers are not kept (the consolidated copies are kept as text, decoded
    afresh when looked up), and the garbage collector paused while they are made is on again after, or stays off
    when the caller had turned it off."""
    import gc

    from dcp_zarr.storage import open_storage
    from dcp_zarr.store_io.root_document import read_manifest

    storage = open_storage(saved_at[4][0], read_only=True)
    for was_enabled in (True, False):
        (gc.enable if was_enabled else gc.disable)()
        try:
            gc.collect()
            before = len(gc.get_objects())
            manifest = read_manifest(storage)
            gc.collect()
            kept = len(gc.get_objects()) - before
            assert gc.isenabled() is was_enabled
        finally:
            gc.enable()
        arrays = sum(isinstance(e, TensorEntry) for e in manifest.entries.values())
        assert kept < 6 * len(manifest.entries), (kept, arrays)  # decoded copies alone would be ~20 per array
        node = next(e.node for e in manifest.entries.values() if isinstance(e, TensorEntry))
        copy = manifest.node_documents[node]
        assert copy["node_type"] == "array" and copy is not manifest.node_documents[node]
        copy["shape"] = [0]  # a caller's edit of its copy changes nothing kept
        assert manifest.node_documents[node]["shape"] != [0]
