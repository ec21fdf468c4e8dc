"""The step forms' table: each form gives the step of its names, the state of what a name holds, and deletes it
commit marks first; a name of no form is never a step, so never listed nor removed. On a local directory and on an
object store (fsspec's memory://) alike."""

from __future__ import annotations

import os
import shutil
import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import ZarrSavePlanner, ZarrWriter
from dcp_zarr.format.manifest import ROOT_KEY
from dcp_zarr.lifecycle.folders import FINISHED_MARK
from dcp_zarr.lifecycle.records import RECORDS, record_key
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.lifecycle.step_forms import (
    ACCELERATE,
    ACCELERATES_OWN,
    DCP_CHECKPOINT,
    LIGHTNING,
    OURS,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    STEP_FORMS,
    TORCHTITAN,
    StepState,
    form_of,
    parse_step,
)
from dcp_zarr.storage import open_storage
from dcp_zarr.storage.zarr_store import ZarrStoreStorage

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

# (form, a name of it, its step): one single store per form, and accelerate's folder of stores.
NAMES = [(OURS, "step-00000042.zarr", 42), (OURS, "step-7.zarr", 7), (TORCHTITAN, "step-42", 42),
         (LIGHTNING, "epoch=3-step=120.ckpt", 120), (LIGHTNING, "epoch=0-step=5", 5), (ACCELERATE, "checkpoint_3", 3)]
NOT_STEPS = ["step-7.zarr.bak", "xstep-3", "step-", "step-3.zarr.tmp", "checkpoint_", "checkpoint_3.tmp",
             "epoch=1-step=2.pt", "notes.txt", ".step-3.zarr", RECORDS, "other.zarr"]
STORE = "pytorch_model_fsdp_0"  # a store in accelerate's folder


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> dict[str, bytes]:
    """A committed store's files, key by key (saved once, written wherever a test needs one)."""
    path = tmp_path_factory.mktemp("committed") / "store"
    dcp.save({"w": torch.arange(12.0).reshape(4, 3)}, storage_writer=ZarrWriter(str(path)), planner=ZarrSavePlanner())
    files = {}
    for directory, _, names in os.walk(path):
        for name in names:
            key = os.path.relpath(os.path.join(directory, name), path).replace(os.sep, "/")
            files[key] = open(os.path.join(directory, name), "rb").read()
    return files


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> CheckpointRoot:
    if request.param == "local":
        return CheckpointRoot(tmp_path / "run")
    return CheckpointRoot(f"memory://step-forms-{uuid.uuid4().hex[:8]}/run")


def _write(root: CheckpointRoot, name: str, files: dict[str, bytes]) -> None:
    storage = root.open(name, read_only=False)
    for key, data in files.items():
        storage.write(key, [data])


def _committed_step(root: CheckpointRoot, name: str, committed: dict[str, bytes]) -> None:
    """A complete checkpoint under ``name``: one committed store, or accelerate's folder of one, finished."""
    if form_of(name)[0] is ACCELERATE:
        _write(root, name, {f"{STORE}/{key}": data for key, data in committed.items()} | {FINISHED_MARK: b"rng"})
    else:
        _write(root, name, committed)


# -- names ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form, name, step", NAMES, ids=[name for _, name, _ in NAMES])
def test_each_form_gives_the_step_of_its_names_and_no_other_form_matches_them(form, name, step):
    assert form.step(name) == step
    assert form_of(name) == (form, step) and parse_step(name) == step
    assert [other for other in STEP_FORMS if other.step(name) is not None] == [form]


@pytest.mark.parametrize("name", NOT_STEPS)
def test_a_name_of_no_form_is_not_a_step(name):
    assert form_of(name) is None and parse_step(name) is None


def test_torchtitans_step_folders_are_matched_by_the_tables_own_pattern():
    from dcp_zarr.integrations import torchtitan

    assert torchtitan._STEP_FOLDER is TORCHTITAN.pattern


# -- states --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form, name, step", NAMES, ids=[name for _, name, _ in NAMES])
def test_a_committed_checkpoint_of_each_form_is_complete_and_listed(root, committed, form, name, step):
    _committed_step(root, name, committed)
    assert form.state(root, name).complete
    [store] = root.step_stores()
    assert (store.step, store.name, store.complete, store.other_format) == (step, name, True, None)
    assert root.size(name) == sum(map(len, committed.values())) + (3 if form is ACCELERATE else 0)


@pytest.mark.parametrize("form, name, step", NAMES, ids=[name for _, name, _ in NAMES])
def test_a_save_stopped_before_its_commit_is_incomplete_in_every_form(root, committed, form, name, step):
    """Every chunk of a real save is there; only the commit marker is missing."""
    _committed_step(root, name, committed)
    if form is ACCELERATE:
        root.open(name, read_only=False).remove(f"{STORE}/{ROOT_KEY}")
    else:
        root.open(name, read_only=False).remove(ROOT_KEY)
    state = form.state(root, name)
    assert not state.complete and state.other_format is None and state.folder == (form is ACCELERATE)


@pytest.mark.parametrize("marker, what", [(".metadata", DCP_CHECKPOINT), (SAFETENSORS_INDEX, SAFETENSORS)])
@pytest.mark.parametrize("form, name", [(OURS, "step-00000001.zarr"), (TORCHTITAN, "step-1"),
                                        (LIGHTNING, "epoch=0-step=1.ckpt")])
def test_another_formats_checkpoint_in_a_store_form_is_named_not_incomplete(root, form, name, marker, what):
    _write(root, name, {marker: b"{}"})
    assert form.state(root, name) == StepState(False, what)


def test_an_accelerate_folder_of_its_own_dcp_checkpoints_is_another_format(root):
    _write(root, "checkpoint_2", {f"{STORE}/.metadata": b"dcp", FINISHED_MARK: b"rng"})
    state = ACCELERATE.state(root, "checkpoint_2")
    assert (state.complete, state.other_format, state.folder) == (False, ACCELERATES_OWN, True)


def test_an_accelerate_folder_accelerate_did_not_finish_is_incomplete_though_its_stores_are_whole(root, committed):
    _write(root, "checkpoint_4", {f"{STORE}/{key}": data for key, data in committed.items()})
    state = ACCELERATE.state(root, "checkpoint_4")
    assert (state.complete, state.folder) == (False, True)


def test_names_of_no_form_are_neither_listed_nor_removed(root, committed):
    for name in NOT_STEPS:
        if name != RECORDS:
            _write(root, name, committed)
    _committed_step(root, "step-00000001.zarr", committed)
    assert [s.name for s in root.step_stores()] == ["step-00000001.zarr"]
    assert root.clean_leftovers() == []
    root.delete_step(1)
    assert root.step_stores() == []
    assert set(NOT_STEPS) - {RECORDS} <= set(root.names())


# -- deleting ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form, name, step", NAMES, ids=[name for _, name, _ in NAMES])
def test_each_form_is_deleted_whole_and_its_neighbours_stay(root, committed, form, name, step):
    _committed_step(root, name, committed)
    _committed_step(root, "step-00000999.zarr", committed)
    _write(root, "notes", {"notes.txt": b"mine"})
    root.delete_step(step, name)
    assert [s.name for s in root.step_stores()] == ["step-00000999.zarr"]
    assert root.size(name) == 0 and "notes" in root.names() and root.records() == []


@pytest.mark.parametrize("form, name, step", NAMES, ids=[name for _, name, _ in NAMES])
def test_on_an_object_store_a_deletion_is_recorded_and_removes_the_commit_marks_first(committed, monkeypatch, form,
                                                                                      name, step):
    root = CheckpointRoot(f"memory://step-forms-{uuid.uuid4().hex[:8]}/run")
    _committed_step(root, name, committed)
    calls = []
    real_write, real_remove, real_remove_all = ZarrStoreStorage.write, ZarrStoreStorage.remove, \
        ZarrStoreStorage.remove_all
    monkeypatch.setattr(ZarrStoreStorage, "write",
                        lambda self, key, buffers: (calls.append(("write", key)), real_write(self, key, buffers))[1])
    monkeypatch.setattr(ZarrStoreStorage, "remove",
                        lambda self, key: (calls.append(("remove", key)), real_remove(self, key))[1])
    monkeypatch.setattr(ZarrStoreStorage, "remove_all",
                        lambda self: (calls.append(("remove_all", self.url)), real_remove_all(self))[1])
    root.delete_step(step, name)
    assert calls == [("write", record_key("deleting", step)),
                     *[("remove", mark) for mark in form.commit_marks],
                     ("remove_all", root.location(name)),
                     ("remove", record_key("deleting", step))]
    assert root.step_stores() == []


def test_on_an_object_store_an_interrupted_deletion_is_finished_by_the_next_cleanup(committed):
    root = CheckpointRoot(f"memory://step-forms-{uuid.uuid4().hex[:8]}/run")
    _committed_step(root, "step-00000003.zarr", committed)
    root.write_record("deleting", 3, {"step": 3})
    root.open("step-00000003.zarr", read_only=False).remove(ROOT_KEY)  # it stopped after the commit marker
    assert root.clean_leftovers() == ["step-00000003.zarr (a deletion that was interrupted)"]
    assert root.names() == [] and root.records() == []  # an object store has no empty folders


def test_a_local_deletion_renames_the_store_away_before_removing_it(tmp_path, committed, monkeypatch):
    root = CheckpointRoot(tmp_path)
    _committed_step(root, "step-5", committed)
    renamed = []
    real_rename, real_rmtree = os.rename, shutil.rmtree
    monkeypatch.setattr(os, "rename", lambda a, b: (renamed.append((a, b)), real_rename(a, b))[1])
    monkeypatch.setattr(shutil, "rmtree",
                        lambda path, **kw: (renamed.append(("rmtree", path)), real_rmtree(path, **kw))[1])
    root.delete_step(5, "step-5")
    [(source, aside), (removed, gone)] = renamed
    assert source == str(tmp_path / "step-5") and removed == "rmtree" and gone == aside
    assert os.listdir(tmp_path) == [] and open_storage(str(tmp_path)).list_names() == []
