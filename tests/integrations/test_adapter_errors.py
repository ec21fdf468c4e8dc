"""What the framework adapters say when a load or a save cannot go ahead: the path at fault, what is there (an
interrupted save, nothing, another format's checkpoint), that nothing was loaded or written, and the framework's own
next step (the config line, the argument, the folder to remove), before DCP starts."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_zarr import CheckpointExistsError, IncompleteCheckpointError, NotACheckpointError
from dcp_zarr.integrations.framework import refuse_unless_committed
from tests.support.states import save_plain

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STATE = {"w": torch.ones(3), "meta": {"epoch": 1}}


def _interrupted(path) -> None:
    """A store whose save stopped before its commit: its root zarr.json never arrived."""
    save_plain(STATE, str(path))
    os.remove(path / "zarr.json")


# -- the check every adapter makes ----------------------------------------------------------------------------------


def test_a_committed_store_passes(tmp_path):
    save_plain(STATE, str(tmp_path / "ckpt.zarr"))

    refuse_unless_committed(tmp_path / "ckpt.zarr", "who", "instead")


def test_an_interrupted_save_is_named_as_one_with_the_next_step(tmp_path):
    path = tmp_path / "step-3"
    _interrupted(path)

    with pytest.raises(IncompleteCheckpointError) as info:
        refuse_unless_committed(path, "Adapter.load", "Do this instead.")

    assert str(info.value) == (
        f"Adapter.load: {path} holds an interrupted dcp_zarr save, not a checkpoint (it has groups and arrays but no "
        "root zarr.json, which a save writes last): its save stopped before the commit, so nothing loads it. "
        "Nothing was loaded. Do this instead.")


def test_a_manifest_not_marked_complete_is_an_interrupted_save_too(tmp_path):
    path = tmp_path / "step-3"
    save_plain(STATE, str(path))
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["dcp_zarr"]["complete"] = False
    (path / "zarr.json").write_text(json.dumps(root))

    with pytest.raises(IncompleteCheckpointError, match=r"holds an interrupted dcp_zarr save, not a checkpoint \(.*"
                                                        r"the manifest is not marked complete\)"):
        refuse_unless_committed(path, "Adapter.load", "Do this instead.")


@pytest.mark.parametrize("what", ["missing", "file", "empty", "foreign"])
def test_a_path_without_a_store_says_what_is_there(tmp_path, what):
    path = tmp_path / "ckpt"
    if what == "file":
        path.write_bytes(b"weights")
    elif what in ("empty", "foreign"):
        path.mkdir()
    if what == "foreign":
        for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
            (path / name).write_text("x")

    with pytest.raises(NotACheckpointError) as info:
        refuse_unless_committed(path, "Adapter.load", "Do this instead.")

    said = {"missing": "does not exist", "file": "is a file, not a checkpoint directory",
            "empty": "is an empty directory",
            "foreign": "holds no dcp_zarr checkpoint (no committed root zarr.json; it holds a.txt, b.txt, c.txt, ...)"}
    assert str(info.value) == f"Adapter.load: {path} {said[what]}. Nothing was loaded. Do this instead."
    assert what != "missing" or not tmp_path.joinpath("ckpt").exists()  # looking made nothing


# -- each adapter's next step ----------------------------------------------------------------------------------------


@pytest.mark.frameworks
def test_torchtitan_names_the_load_step_or_the_initial_load_path(tmp_path):
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    folder = tmp_path / "checkpoint"
    _interrupted(folder / "step-20")
    manager = SimpleNamespace(folder=str(folder))
    manager._load_instead = lambda checkpoint_id: ZarrCheckpointManager._load_instead(manager, checkpoint_id)

    with pytest.raises(IncompleteCheckpointError) as info:
        ZarrCheckpointManager.dcp_load(manager, {}, str(folder / "step-20"), False, False)
    assert str(info.value).startswith(f"ZarrCheckpointManager.dcp_load: {folder / 'step-20'} holds an interrupted "
                                      "dcp_zarr save")
    assert str(info.value).endswith(
        f"Nothing was loaded. checkpoint.load_step=20 names it: set load_step to a step that `dcp-zarr list {folder}` "
        f"shows complete, or to -1 (the newest complete one), or remove it (rm -r {folder / 'step-20'})")

    with pytest.raises(NotACheckpointError) as info:
        ZarrCheckpointManager.dcp_load(manager, {}, str(tmp_path / "elsewhere"), False, False)
    assert str(info.value) == (
        f"ZarrCheckpointManager.dcp_load: {tmp_path / 'elsewhere'} does not exist. Nothing was loaded. "
        "checkpoint.initial_load_path names it: point it at a committed dcp_zarr store, a DCP directory (.metadata) "
        "or, with checkpoint.initial_load_in_hf, Hugging Face safetensors")


@pytest.mark.frameworks
def test_torchtitan_refuses_to_save_over_its_own_dcp_checkpoint_saying_what_to_remove(tmp_path):
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager, _AsyncMode

    step = tmp_path / "step-20"
    dcp.save(STATE, storage_writer=FileSystemWriter(str(step)))

    with pytest.raises(CheckpointExistsError) as info:
        ZarrCheckpointManager.dcp_save(SimpleNamespace(), dict(STATE), str(step), _AsyncMode.DISABLED)

    assert str(info.value) == (
        f"ZarrCheckpointManager.dcp_save: {step} holds a checkpoint torchtitan's own manager saved (DCP's .metadata "
        "and .distcp files), which a zarr store is not saved over: this save was refused and nothing was written. "
        f"Remove it (rm -r {step}) to save this step as a zarr store; until then a resume loads it as it is, "
        "through torchtitan's own reader")
    assert sorted(os.listdir(step)) == [".metadata", "__0_0.distcp"]


@pytest.mark.frameworks
def test_lightning_names_the_ckpt_path(tmp_path):
    from dcp_zarr.integrations import lightning

    path = tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"
    _interrupted(path)

    with lightning._through_zarr() as routed, pytest.raises(IncompleteCheckpointError) as info:
        lightning._load_stand_in(lambda state, path: None)({}, path)

    assert str(info.value).startswith(f"dcp_zarr's Lightning strategy (load_checkpoint): {path} holds an "
                                      "interrupted dcp_zarr save")
    assert str(info.value).endswith(f"Nothing was loaded. Pass another ckpt_path (`dcp-zarr list {path.parent}` "
                                    "shows which checkpoints there are complete), or remove this one")
    assert routed.loaded == [path]  # refused by dcp_zarr: not taken for a load Lightning never routed


@pytest.mark.frameworks
def test_accelerate_names_the_checkpoint_folder_and_load_state_without_a_path(tmp_path):
    from dcp_zarr.integrations import accelerate

    store = tmp_path / "checkpoints" / "checkpoint_3" / "optimizer_0"
    _interrupted(store)

    with pytest.raises(IncompleteCheckpointError) as info:
        accelerate._load({}, str(store))

    assert str(info.value).startswith(f"ZarrAccelerator.load_state: {store} holds an interrupted dcp_zarr save")
    assert str(info.value).endswith(
        f"Nothing was loaded. load_state({str(store.parent)!r}) names it: pass a checkpoint_N that `dcp-zarr list "
        f"{tmp_path / 'checkpoints'}` shows complete, or call load_state() without a path to resume from the newest "
        "complete one")
