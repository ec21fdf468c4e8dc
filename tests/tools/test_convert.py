"""Conversions: DCP directory -> zarr store; checkpoint -> torch.save file; checkpoint -> safetensors (HF layout)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter

from dcp_zarr import CheckpointExistsError, IncompleteCheckpointError, ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.tools.convert import ConversionError, convert
from dcp_zarr.tools.dcp_dir import DcpCheckpoint
from dcp_zarr.tools.diff import diff_checkpoints
from tests.support.compare import assert_state_equal
from tests.support.models import build, full_state, load_checkpoint, train_and_save
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _train_and_save_dcp(rank, world_size, path):
    return train_and_save(rank, world_size, "fsdp2", FileSystemWriter(path))[0]


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    """A 2-rank FSDP2 checkpoint written by DCP's own FileSystemWriter, and the full state it holds."""
    path = tmp_path_factory.mktemp("dcp") / "step2"
    saved = run_ranks(_train_and_save_dcp, 2, str(path))[0]
    return path, saved


@pytest.fixture(scope="module")
def zarr_store(dcp_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("converted") / "step2.zarr"
    convert(dcp_dir[0], path, "zarr")
    return path


def mixed_dtype_store(path):
    state = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4).to(torch.bfloat16),
                       "q": torch.randn(3, 3).to(torch.float8_e5m2), "ids": torch.arange(5)},
             "optim": {"state": {"w": {"step": torch.tensor(2.0)}}}, "epoch": 1}
    dcp.save(state, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path))
    return state


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dcp_directory_converts_to_a_zarr_store_holding_the_same_state(dcp_dir, zarr_store):
    path, saved = dcp_dir

    assert_state_equal(open_checkpoint(zarr_store).load_full_state_dict(), saved)
    assert diff_checkpoints(DcpCheckpoint(path), open_checkpoint(zarr_store)).same


@pytest.mark.slow
@pytest.mark.distributed
def test_the_converted_store_loads_with_dcp_into_a_model(dcp_dir, zarr_store):
    _, saved = dcp_dir
    model, optim = build("plain", 1, seed=5)

    load_checkpoint(model, optim, ZarrReader(zarr_store))

    assert_state_equal(full_state(model, optim), saved)


@pytest.mark.slow
@pytest.mark.distributed
def test_missing_or_truncated_distcp_files_are_named_before_anything_is_written(dcp_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(dcp_dir[0], broken)
    os.remove(broken / "__1_0.distcp")

    with pytest.raises(IncompleteCheckpointError, match=r"missing data files \['__1_0.distcp'\]"):
        convert(broken, tmp_path / "out.zarr", "zarr")
    assert not (tmp_path / "out.zarr").exists()

    shutil.copy(dcp_dir[0] / "__1_0.distcp", broken / "__1_0.distcp")
    with open(broken / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(IncompleteCheckpointError, match=r"truncated data files \['__0_0.distcp'\]"):
        convert(broken, tmp_path / "out.zarr", "zarr")


@pytest.mark.slow
@pytest.mark.distributed
def test_an_existing_target_is_replaced_only_with_overwrite(dcp_dir, zarr_store, tmp_path):
    target = tmp_path / "copy.zarr"
    shutil.copytree(zarr_store, target)
    before = open_checkpoint(target).manifest.save_id

    with pytest.raises(CheckpointExistsError, match="already holds a checkpoint"):
        convert(dcp_dir[0], target, "zarr")
    assert open_checkpoint(target).manifest.save_id == before
    convert(dcp_dir[0], target, "zarr", overwrite=True)
    assert open_checkpoint(target).manifest.save_id != before

    other = tmp_path / "notes"
    other.mkdir()
    (other / "README").write_text("mine")
    with pytest.raises(CheckpointExistsError):
        convert(dcp_dir[0], other, "zarr", overwrite=True)
    assert (other / "README").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.distributed
def test_zarr_to_torch_save_gives_a_file_torch_load_reads_with_weights_only(zarr_store, dcp_dir, tmp_path):
    out = tmp_path / "full.pt"

    assert convert(zarr_store, out, "torch") == [str(out)]

    assert_state_equal(torch.load(out, weights_only=True), dcp_dir[1])
    with pytest.raises(CheckpointExistsError, match="--overwrite"):
        convert(zarr_store, out, "torch")
    out.write_bytes(b"old")
    convert(zarr_store, out, "torch", overwrite=True)
    assert_state_equal(torch.load(out, weights_only=True), dcp_dir[1])


def test_safetensors_holds_the_model_weights_by_fqn_in_every_dtype(tmp_path):
    state = mixed_dtype_store(tmp_path / "ckpt.zarr")

    written = convert(tmp_path / "ckpt.zarr", tmp_path / "weights.safetensors", "safetensors")

    loaded = load_file(written[0])
    assert sorted(loaded) == ["b", "ids", "q", "w"]  # the "model." group, without its prefix; no optimizer state
    for name, tensor in state["model"].items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name].view(torch.uint8),
                                                                  tensor.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.distributed
def test_large_models_are_sharded_with_a_hugging_face_index(zarr_store, dcp_dir, tmp_path):
    out = tmp_path / "hf"
    model = dcp_dir[1]["model"]

    written = convert(zarr_store, out, "safetensors", max_shard_bytes=1024)

    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(written) == sorted(str(out / n) for n in os.listdir(out))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(model)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.values())
    loaded = {}
    for shard in shards:
        part = load_file(out / shard)
        assert all(index["weight_map"][name] == shard for name in part)
        loaded.update(part)
    assert_state_equal(loaded, model)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_safetensors_directory_is_replaced_only_if_it_holds_nothing_else(zarr_store, tmp_path):
    out = tmp_path / "hf"
    convert(zarr_store, out, "safetensors")
    assert os.listdir(out) == ["model.safetensors"]

    with pytest.raises(CheckpointExistsError):
        convert(zarr_store, out, "safetensors")
    convert(zarr_store, out, "safetensors", overwrite=True, max_shard_bytes=2048)
    assert "model.safetensors.index.json" in os.listdir(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="other files"):
        convert(zarr_store, out, "safetensors", overwrite=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dcp_directory_converts_straight_to_safetensors(dcp_dir, tmp_path):
    written = convert(dcp_dir[0], tmp_path / "w.safetensors", "safetensors")

    assert_state_equal(load_file(written[0]), dcp_dir[1]["model"])


@pytest.mark.slow
@pytest.mark.distributed
def test_conversions_that_cannot_be_done_say_why(zarr_store, tmp_path):
    (tmp_path / "empty").mkdir()  # a zarr store converts to zarr too (test_compressed_tools.py); not anything else
    with pytest.raises(ConversionError, match="is neither a DCP checkpoint directory .* nor a dcp_zarr store"):
        convert(tmp_path / "empty", tmp_path / "again.zarr", "zarr")
    assert not (tmp_path / "again.zarr").exists()
    with pytest.raises(ConversionError, match="must be local"):
        convert(zarr_store, "s3://bucket/full.pt", "torch")
    with pytest.raises(ConversionError, match="unknown target format"):
        convert(zarr_store, tmp_path / "x", "onnx")
    with pytest.raises(ConversionError, match="parent directory does not exist"):
        convert(zarr_store, tmp_path / "no" / "such" / "full.pt", "torch")
