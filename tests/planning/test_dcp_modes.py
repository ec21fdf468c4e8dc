"""DCP's modes and the conventions of the frameworks that call it: ``use_collectives=False``, process-executor async
saves with a planner holding a process group, step folders as frameworks name them, and staging folders that no
framework's step pattern can match."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_zarr import UnsupportedModeError, ZarrReader, ZarrSavePlanner, ZarrWriter, open_checkpoint
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.store_io import commit
from dcp_zarr.tools.cli import main as cli_main
from tests.support.compare import assert_state_equal
from tests.support.ranks import run_ranks
from tests.support.stores import tree_digest

# The step patterns the frameworks scan their checkpoint folders with (torchtitan's CheckpointManager searches each
# name for the first, Lightning's ModelCheckpoint names its files with the second, accelerate sorts by the last
# number of a name).
FRAMEWORK_STEP_PATTERNS = [re.compile(r"step-(\d+)"), re.compile(r"step=(\d+)"), re.compile(r"checkpoint_(\d+)")]


def _sharded_state(world_size: int, seed: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(37 * 5, dtype=torch.float32).reshape(37, 5) + seed
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.full((3,), float(seed)), "step": seed}


# -- use_collectives=False -----------------------------------------------------------------------------------------


def save_without_collectives(rank, world_size, path, planned):
    state = _sharded_state(world_size, seed=7)
    planner = ZarrSavePlanner() if planned else None
    try:
        dcp.save(state, storage_writer=ZarrWriter(path), planner=planner, use_collectives=False)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException; the type is the result
        causes = [c for c, _ in getattr(exc, "failures", {}).values()] if hasattr(exc, "failures") else [exc]
        return [type(c).__name__ + ": " + str(c) for c in causes]
    return None


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("planned", [True, False], ids=["ZarrSavePlanner", "DCP's planner"])
@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "over a checkpoint"])
def test_use_collectives_false_is_refused_on_every_rank_before_anything_is_written(tmp_path, world_size, planned,
                                                                                    existing):
    path = str(tmp_path / "ckpt.zarr")
    if existing:
        dcp.save({"b": torch.ones(3)}, storage_writer=ZarrWriter(path), planner=ZarrSavePlanner())
        before = tree_digest(path)
    errors = run_ranks(save_without_collectives, world_size, path, planned)
    for rank, rank_errors in enumerate(errors):
        assert rank_errors and all("UnsupportedModeError" in e and "use_collectives=False" in e for e in rank_errors), \
            f"rank {rank}: {rank_errors}"
    if existing:
        assert tree_digest(path) == before, "the checkpoint already there is untouched"
        assert sorted(os.listdir(tmp_path)) == ["ckpt.zarr"]
    else:
        assert os.listdir(tmp_path) == [], "nothing was written: no store, no staging directory"


def test_use_collectives_false_names_the_mode_and_the_fix_in_one_process(tmp_path):
    with pytest.raises(UnsupportedModeError, match=r"use_collectives=False.*ZarrSavePlanner"):
        dcp.save({"b": torch.ones(3)}, storage_writer=ZarrWriter(str(tmp_path / "x.zarr")), use_collectives=False)
    assert os.listdir(tmp_path) == []


# -- a planner holding a process group, pickled into the process executor ------------------------------------------


def async_save_in_a_process_with_a_planner_on_a_group(rank, world_size, path):
    """As torchtitan does: a gloo group of the checkpointer's own, passed to async_save and to the planner."""
    state = _sharded_state(world_size, seed=3)
    group = dist.new_group(backend="gloo")
    planner = ZarrSavePlanner(process_group=group)
    expected = {"w": state["w"].full_tensor().clone(), "b": state["b"].clone(), "step": 3}
    for i in range(2):  # one planner for both saves: the second is pickled after the first was sent
        future = dcp.async_save(state, storage_writer=ZarrWriter(f"{path}/{i}"), planner=planner, process_group=group,
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        future.result()
    return expected


@pytest.mark.distributed
@pytest.mark.slow
def test_a_process_executor_save_works_with_a_planner_that_holds_a_process_group(tmp_path):
    expected = run_ranks(async_save_in_a_process_with_a_planner_on_a_group, 2, str(tmp_path), timeout=240)[0]
    for i in range(2):
        assert_state_equal(open_checkpoint(str(tmp_path / str(i))).load_full_state_dict(), expected)


def test_a_pickled_planner_forgets_its_group_and_its_last_save():
    import pickle

    planner = ZarrSavePlanner(process_group=object())  # not picklable, as a ProcessGroup is not
    planner.set_up_planner({"x": torch.ones(2)}, is_coordinator=True)
    planner.create_local_plan()  # holds the rank's state, which refuses to be pickled
    copy = pickle.loads(pickle.dumps(planner))
    assert copy.process_group is None and not hasattr(copy, "state_dict") and not hasattr(copy, "plan")
    copy.set_up_planner({"y": torch.zeros(1)}, is_coordinator=True)
    assert copy.create_local_plan().planner_data.items[0].index.fqn == "y"


# -- step folders as frameworks name them, and staging folders that match none of their patterns -------------------


def test_a_saves_staging_folder_matches_no_frameworks_step_pattern(tmp_path, monkeypatch):
    """Seen from the checkpoint folder while a save of ``step-4`` is being committed, and while one of Lightning's
    ``epoch=0-step=4.ckpt`` is: nothing but finished checkpoints carries a step."""
    seen = []
    real_commit = commit.commit

    def look_then_commit(staging, target, replace=False):
        seen.append((os.path.basename(target), sorted(os.listdir(tmp_path)), staging.url))
        real_commit(staging, target, replace)

    monkeypatch.setattr(commit, "commit", look_then_commit)
    for name in ("step-4", "epoch=0-step=4.ckpt", "checkpoint_4"):
        dcp.save({"b": torch.ones(3)}, storage_writer=ZarrWriter(str(tmp_path / name)), planner=ZarrSavePlanner())
    for target, names, staging in seen:
        assert os.path.basename(os.path.dirname(staging)) == commit.STAGING_DIR, staging
        for name in names:
            for pattern in FRAMEWORK_STEP_PATTERNS:
                match = pattern.search(name)
                assert match is None or name in {"step-4", "epoch=0-step=4.ckpt", "checkpoint_4"}, \
                    f"while committing {target}: {name!r} matches {pattern.pattern}"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_4", "epoch=0-step=4.ckpt", "step-4"], "no staging left"


def _framework_folder(root) -> None:
    """torchtitan's and Lightning's step folders, each a dcp_zarr store, a DCP checkpoint and a foreign file."""
    for name, step in (("step-10", 10), ("step-20", 20), ("epoch=1-step=30.ckpt", 30), ("step-40", 40)):
        dcp.save({"w": torch.full((2,), float(step))}, storage_writer=ZarrWriter(str(root / name)),
                 planner=ZarrSavePlanner())
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(root / "step-5")))
    (root / "step-log.txt").write_text("not a checkpoint")


def test_list_recognizes_framework_step_folders_and_tells_other_formats_apart(tmp_path, capsys):
    _framework_folder(tmp_path)
    assert cli_main(["list", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["store"], r["complete"]) for r in listing["steps"]] == [
        (5, "step-5", False), (10, "step-10", True), (20, "step-20", True), (30, "epoch=1-step=30.ckpt", True),
        (40, "step-40", True)]
    assert listing["steps"][0]["other_format"] == "a DCP checkpoint (FileSystemWriter)"
    assert cli_main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not dcp_zarr: a DCP checkpoint (FileSystemWriter)" in out
    assert "never pruned nor loaded by a CheckpointManager" in out


def test_prune_keeps_the_newest_framework_steps_and_never_touches_other_formats(tmp_path, capsys):
    _framework_folder(tmp_path)
    assert cli_main(["prune", str(tmp_path), "--keep-last", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["deleted"] == [10, 20] and result["kept"] == [30, 40]
    assert sorted(os.listdir(tmp_path)) == [".dcp-zarr", "epoch=1-step=30.ckpt", "step-40", "step-5", "step-log.txt"]
    target = {"w": torch.zeros(2)}
    dcp.load(target, storage_reader=ZarrReader(str(tmp_path / "step-40")))
    assert torch.equal(target["w"], torch.full((2,), 40.0))


def test_an_empty_listing_says_which_names_count_as_steps(tmp_path, capsys):
    (tmp_path / "checkpoints-of-something").mkdir()
    assert cli_main(["list", str(tmp_path)]) == 0
    assert "names recognized: step-N.zarr, step-N, epoch=E-step=N" in capsys.readouterr().out


def test_the_manager_finds_no_step_in_another_formats_folder(tmp_path):
    from dcp_zarr import CheckpointManager, StepNotFoundError

    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "step-5")))
    with CheckpointManager(tmp_path) as manager:
        assert manager.steps() == []
        with pytest.raises(StepNotFoundError) as info:
            manager.load({"w": torch.zeros(2)})
    assert "step-5" not in str(info.value), "a DCP folder is not an incomplete dcp_zarr store"
    assert CheckpointRoot(tmp_path).step_stores()[0].other_format is not None
