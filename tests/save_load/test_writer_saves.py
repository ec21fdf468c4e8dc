"""One ZarrWriter, many saves: each save is its own object (dcp_zarr/saving/), chosen once and dropped with the save,
so nothing of one save is left on the writer for the next."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_zarr import ZarrSavePlanner, ZarrWriter, open_checkpoint
from dcp_zarr.saving.dcp_planned_save import DcpPlannedSave
from dcp_zarr.saving.locally_planned_save import LocallyPlannedSave
from tests.support.faults import causes
from tests.support.ranks import run_ranks

# What a save may change on the writer: the path (checkpoint_id=), the keys it wrote, and async staging's own
# bookkeeping of whether a staged copy is still being saved.
_PER_SAVE = {"settings.path", "written_keys", "_save_thread", "_staged"}


class _PlansForItself(DefaultSavePlanner):
    """A planner DCP's planning is left to (it overrides create_local_plan): the save is planned by DCP."""

    def create_local_plan(self):
        return super().create_local_plan()


def _changed(writer: ZarrWriter, before: dict) -> set[str]:
    changed = {name for name, value in vars(writer).items() if before.get(name, _changed) is not value}
    if "settings" in changed:  # checkpoint_id= gives the writer's settings another path, and nothing else
        old, new = vars(before["settings"]), vars(writer.settings)
        changed.remove("settings")
        changed |= {f"settings.{name}" for name in old.keys() | new.keys() if old.get(name) is not new.get(name)}
    return changed


def three_saves(rank: int, world_size: int, root: str):
    """A save planned locally, one planned by DCP, then a locally planned one whose replicas differ: each leaves the
    writer holding its own written keys only, and no save object."""
    writer = ZarrWriter(os.path.join(root, "unused"))
    before = dict(vars(writer))
    seen = []
    made = []
    for cls in (LocallyPlannedSave, DcpPlannedSave):
        real = cls.__init__

        def recording(self, *args, _real=real, **kwargs):
            made.append(type(self).__name__)
            _real(self, *args, **kwargs)

        cls.__init__ = recording  # type: ignore[method-assign]
    dcp.save({f"own.rank{rank}": torch.full((64, 8), float(rank))}, storage_writer=writer,
             checkpoint_id=os.path.join(root, "local.zarr"))
    seen.append((list(made), sorted(writer.written_keys), writer._save is None))
    made.clear()
    dcp.save({f"mine.rank{rank}": torch.full((32, 4), float(rank))}, storage_writer=writer,
             planner=_PlansForItself(), checkpoint_id=os.path.join(root, "dcp.zarr"))
    seen.append((list(made), sorted(writer.written_keys), writer._save is None))
    made.clear()
    try:
        dcp.save({"same": torch.full((4,), float(rank))}, storage_writer=writer, planner=ZarrSavePlanner(),
                 checkpoint_id=os.path.join(root, "differ.zarr"))
        error = None
    except CheckpointException as exc:
        error = " ".join(type(cause).__name__ for cause in causes(exc))
    seen.append((list(made), sorted(writer.written_keys), writer._save is None, error))
    return seen, sorted(_changed(writer, before))


@pytest.mark.distributed
def test_each_save_through_one_writer_leaves_only_its_own_state(tmp_path):
    results = run_ranks(three_saves, 2, str(tmp_path))
    for rank, (seen, changed) in enumerate(results):
        local, planned_by_dcp, differ = seen
        assert local == (["LocallyPlannedSave"], [f"own.rank{rank}/c.0.0"], True), local
        assert planned_by_dcp == (["DcpPlannedSave"], [f"mine.rank{rank}/c.0.0"], True), planned_by_dcp
        # replicas that differ: nothing written (the checksums go to the coordinator), so no keys, not the last save's
        assert differ == (["LocallyPlannedSave"], [], True, "ReplicaMismatchError"), differ
        assert set(changed) <= _PER_SAVE, changed
    assert sorted(e.fqn for e in open_checkpoint(tmp_path / "local.zarr")) == ["own.rank0", "own.rank1"]
    assert sorted(e.fqn for e in open_checkpoint(tmp_path / "dcp.zarr")) == ["mine.rank0", "mine.rank1"]
    assert not (tmp_path / "differ.zarr").exists()


def test_a_save_failing_mid_way_leaves_nothing_for_the_next(tmp_path):
    """A save that fails after its plan (an entry the writer cannot store) drops its save object; the next save
    through the same writer is whole."""
    writer = ZarrWriter(tmp_path / "unused")
    with pytest.raises(CheckpointException):
        dcp.save({"sparse": torch.eye(3).to_sparse()}, storage_writer=writer, checkpoint_id=tmp_path / "bad.zarr")
    dcp.save({"w": torch.ones(3)}, storage_writer=writer, checkpoint_id=tmp_path / "good.zarr")
    assert writer._save is None and writer.written_keys == ["w/c.0"]
    assert [e.fqn for e in open_checkpoint(tmp_path / "good.zarr")] == ["w"]
