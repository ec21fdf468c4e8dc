"""Every rank of a save or a load names the same checkpoint (planning/same_checkpoint.py). Ranks given different
paths, checkpoint_ids or store objects are refused on every rank, before anything is written or any chunk is
read, with the checkpoints and the ranks that gave each. One directory spelled differently is one checkpoint."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from zarr.storage import FsspecStore

from dcp_zarr import PlanMismatchError, ZarrReader, ZarrSavePlanner, ZarrWriter, open_checkpoint
from dcp_zarr.planning.same_checkpoint import NamedLoadPlan, NamedSavePlan, checked, checkpoint_name, named
from tests.support.compare import assert_state_equal
from tests.support.faults import causes
from tests.support.models import build, train_steps
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REFUSED = "every rank must name the same checkpoint"


def _state(world_size: int, seed: float) -> dict:
    """A DTensor every rank holds a part of, a plain tensor and a value: each rank has something to write."""
    full = torch.arange(37 * 5, dtype=torch.float32).reshape(37, 5) + seed
    mesh = init_device_mesh("cpu", (world_size,))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.full((3,), seed), "step": int(seed)}


def _full(state: dict) -> dict:
    return {"w": state["w"].full_tensor(), "b": state["b"], "step": state["step"]}


def _errors(call) -> list[str] | None:
    """What each failure of ``call()`` was, as ``type: message``; None if it succeeded."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException; the causes are the result
        return [f"{type(c).__name__}: {c}" for c in causes(exc)]
    return None


class _PlansForItself(DefaultSavePlanner):
    """A planner that plans for itself (the writer does not take it over): the save DCP's coordinator plans."""

    def create_local_plan(self):
        return super().create_local_plan()


_PLANNERS = {"DCP's planner": lambda: None, "ZarrSavePlanner": ZarrSavePlanner, "planned by DCP": _PlansForItself}


# -- the names compared -------------------------------------------------------------------------------------------


def test_one_directory_spelled_differently_is_one_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spellings = ["ckpt", "./ckpt/", "sub/../ckpt", str(tmp_path / "ckpt"), f"file://{tmp_path}/ckpt"]
    assert {checkpoint_name(p).key for p in spellings} == {str(tmp_path / "ckpt")}
    assert checkpoint_name("s3://bucket/ckpt/").key == checkpoint_name("s3://bucket/ckpt").key
    assert checkpoint_name("s3://bucket/ckpt").key != checkpoint_name("s3://bucket/other").key
    store = FsspecStore.from_url(f"file://{tmp_path}/ckpt")
    assert checkpoint_name("", store).key == checkpoint_name("", FsspecStore.from_url(f"file://{tmp_path}/ckpt/")).key
    assert checkpoint_name("", store).key != checkpoint_name(str(tmp_path / "ckpt")).key, \
        "a store is written in place, a path through its staging area: never one checkpoint"


def test_the_message_names_each_checkpoint_once_with_the_ranks_that_gave_it():
    a, b = checkpoint_name("/a/ckpt"), checkpoint_name("b/ckpt")
    plans = [NamedSavePlan([], checkpoint=name) for name in (a, b, a, a)]
    with pytest.raises(PlanMismatchError) as raised:
        checked(plans, saving=True)
    assert str(raised.value).startswith(f"ranks 0, 2, 3 save to /a/ckpt, rank 1 to b/ckpt ({os.path.abspath('b/ckpt')})"
                                        f": {REFUSED}")
    assert str(raised.value).endswith("Nothing was written")
    with pytest.raises(PlanMismatchError, match=f"^rank 0 loads from /a/ckpt, rank 1 from /c/: {REFUSED}"):
        checked([NamedLoadPlan([], checkpoint=checkpoint_name("/a/ckpt")),
                 NamedLoadPlan([], checkpoint=checkpoint_name("/c/"))], saving=False)
    # a path with the rank in it: a bounded message
    with pytest.raises(PlanMismatchError) as raised:
        checked([NamedSavePlan([], checkpoint=checkpoint_name(f"/ckpt/rank{r}")) for r in range(1000)], saving=True)
    assert "and 992 other ranks to 992 other checkpoints" in str(raised.value) and len(str(raised.value)) < 1000


def test_agreeing_names_are_taken_off_and_only_this_saves_names_are_compared():
    a, b = checkpoint_name("/a/ckpt"), checkpoint_name("/b/ckpt")
    plans = checked([NamedSavePlan([], storage_data=r, checkpoint=a) for r in range(3)], saving=True)
    assert [type(p) for p in plans] == [SavePlan] * 3 and [p.storage_data for p in plans] == [0, 1, 2]
    # A caching planner's unchanged plan: a placeholder without a name, or, put back by DCP's coordinator, the plan
    # it cached at an earlier save, whose name (the very object, compared then) may be of another checkpoint.
    placeholder = SavePlan([], usable=False)
    assert checked([NamedSavePlan([], checkpoint=b), placeholder], saving=True)[1] is placeholder
    assert checked([NamedSavePlan([], checkpoint=checkpoint_name("/c")), NamedSavePlan([], checkpoint=a)],
                   saving=True)
    with pytest.raises(PlanMismatchError, match="rank 0 saves to /c, rank 2 to /d"):  # this save's still are
        checked([NamedSavePlan([], checkpoint=name) for name in (checkpoint_name("/c"), a, checkpoint_name("/d"))],
                saving=True)


def test_a_name_travels_as_made_and_small():
    name = checkpoint_name("/lustre/project/run-42/step-000100")
    name.compared = True
    back = pickle.loads(pickle.dumps(NamedSavePlan([], checkpoint=name))).checkpoint
    assert (back.key, back.given, back.compared) == (name.key, name.given, False)
    plan = SavePlan([], storage_data=("digest" * 8, 8192), planner_data={})
    assert len(pickle.dumps(named(plan, name))) - len(pickle.dumps(plan)) < len(name.key) + 80


# -- saves --------------------------------------------------------------------------------------------------------


def save_to_rank_paths(rank, world_size, paths, planner_kind):
    return _errors(lambda: dcp.save(_state(world_size, 1.0), storage_writer=ZarrWriter(paths[rank]),
                                    planner=_PLANNERS[planner_kind]()))


@pytest.mark.distributed
@pytest.mark.parametrize("planner_kind", list(_PLANNERS))
def test_different_paths_are_refused_on_every_rank_before_anything_is_written(tmp_path, planner_kind):
    a, b = str(tmp_path / "a" / "ckpt.zarr"), str(tmp_path / "b" / "ckpt.zarr")
    os.makedirs(os.path.dirname(a))
    os.makedirs(os.path.dirname(b))
    errors = run_ranks(save_to_rank_paths, 3, [a, b, a], planner_kind)
    for rank, rank_errors in enumerate(errors):
        assert rank_errors, f"rank {rank} saved"
        assert any(e.startswith(f"PlanMismatchError: ranks 0, 2 save to {a}, rank 1 to {b}: {REFUSED}")
                   for e in rank_errors), f"rank {rank}: {rank_errors}"
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == [], \
        "nothing was written: no store, no staging directory, under either path"


def save_spelled_by_rank(rank, world_size, root):
    os.chdir(root)  # this rank's own process: a relative path is taken from its working directory
    spelling = [os.path.join(root, "ckpt.zarr"), "./sub/../ckpt.zarr/", f"file://{root}/ckpt.zarr"][rank]
    state = _state(world_size, 2.0)
    dcp.save(state, storage_writer=ZarrWriter(spelling))
    loaded = _state(world_size, 0.0)
    dcp.load(loaded, storage_reader=ZarrReader(spelling))
    return _full(state), _full(loaded)


@pytest.mark.distributed
def test_one_directory_spelled_differently_by_each_rank_is_saved_and_loaded(tmp_path):
    results = run_ranks(save_spelled_by_rank, 3, str(tmp_path))
    for saved, loaded in results:
        assert_state_equal(loaded, saved)
    assert_state_equal(open_checkpoint(str(tmp_path / "ckpt.zarr")).load_full_state_dict(), results[0][0])


def fsdp2_save_with_checkpoint_ids(rank, world_size, paths):
    model, optim = build("fsdp2", world_size)
    train_steps(model, optim, 1)
    msd, osd = get_state_dict(model, optim)
    return _errors(lambda: dcp.save({"model": msd, "optim": osd}, storage_writer=ZarrWriter(),
                                    checkpoint_id=paths[rank]))


@pytest.mark.distributed
def test_fsdp2_ranks_given_different_checkpoint_ids_are_refused(tmp_path):
    a, b = str(tmp_path / "step-1"), str(tmp_path / "step-1-rank1")
    errors = run_ranks(fsdp2_save_with_checkpoint_ids, 2, [a, b])
    for rank, rank_errors in enumerate(errors):
        assert rank_errors and any(f"rank 0 saves to {a}, rank 1 to {b}: {REFUSED}" in e for e in rank_errors), \
            f"rank {rank}: {rank_errors}"
    assert os.listdir(tmp_path) == [], "nothing was written"


def save_to_rank_stores(rank, world_size, urls):
    # each rank its own store object, as store= is used (fsspec's local file system makes no directories unasked)
    store = FsspecStore.from_url(urls[rank], storage_options={"auto_mkdir": True})
    return _errors(lambda: dcp.save(_state(world_size, 3.0), storage_writer=ZarrWriter(store=store)))


@pytest.mark.distributed
def test_store_objects_of_different_stores_are_refused_and_of_one_store_accepted(tmp_path):
    a, b = f"file://{tmp_path}/a.zarr", f"file://{tmp_path}/b.zarr"
    errors = run_ranks(save_to_rank_stores, 2, [a, b])
    shown_a, shown_b = (checkpoint_name("", FsspecStore.from_url(url)).given for url in (a, b))
    for rank, rank_errors in enumerate(errors):
        assert rank_errors and any(f"rank 0 saves to {shown_a}, rank 1 to {shown_b}: {REFUSED}" in e
                                   for e in rank_errors), f"rank {rank}: {rank_errors}"
    assert os.listdir(tmp_path) == [], "nothing was written"
    assert run_ranks(save_to_rank_stores, 2, [a, a + "/"]) == [None, None]
    assert open_checkpoint(str(tmp_path / "a.zarr")).load_full_state_dict()["step"] == 3


# -- loads --------------------------------------------------------------------------------------------------------


def load_from_rank_paths(rank, world_size, paths, read_once):
    reader = ZarrReader(paths[rank], read_once=read_once)
    target = {"w": torch.zeros(37, 5), "b": torch.zeros(3)}
    errors = _errors(lambda: dcp.load(target, storage_reader=reader))
    return errors, reader.bytes_read, float(target["w"].abs().sum() + target["b"].abs().sum())


@pytest.mark.distributed
@pytest.mark.parametrize("read_once", [False, True], ids=["each rank reads its root", "root read once"])
def test_different_paths_are_refused_on_load_before_any_chunk_is_read(tmp_path, read_once):
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    for path, seed in ((a, 1.0), (b, 2.0)):  # two checkpoints of one shape: each rank could load its own
        dcp.save({"w": torch.full((37, 5), seed), "b": torch.full((3,), seed)}, storage_writer=ZarrWriter(path))
    results = run_ranks(load_from_rank_paths, 2, [a, b], read_once)
    for rank, (rank_errors, bytes_read, loaded) in enumerate(results):
        assert rank_errors and any(f"PlanMismatchError: rank 0 loads from {a}, rank 1 from {b}: {REFUSED}" in e
                                   for e in rank_errors), f"rank {rank}: {rank_errors}"
        assert bytes_read == 0 and loaded == 0.0, f"rank {rank} read chunks"


def load_where_a_rank_finds_nothing(rank, world_size, paths, read_once):
    return _errors(lambda: dcp.load({"w": torch.zeros(2)}, storage_reader=ZarrReader(paths[rank], read_once=read_once)))


@pytest.mark.distributed
@pytest.mark.parametrize("read_once", [False, True], ids=["each rank reads its root", "root read once"])
def test_a_rank_whose_path_holds_no_checkpoint_fails_the_load_on_every_rank_without_a_wait(tmp_path, read_once):
    """Each rank reading its own root, the rank that finds none fails there, before the plans meet: DCP then asks
    it for metadata of its own, which must not wait in the root's broadcast that the other ranks have left."""
    a, missing = str(tmp_path / "a.zarr"), str(tmp_path / "missing.zarr")
    dcp.save({"w": torch.ones(2)}, storage_writer=ZarrWriter(a))
    results = run_ranks(load_where_a_rank_finds_nothing, 2, [a, missing], read_once, timeout=60)
    expected = (f"{missing} is not a dcp_zarr checkpoint" if not read_once else
                f"PlanMismatchError: rank 0 loads from {a}, rank 1 from {missing}: {REFUSED}")
    for rank, rank_errors in enumerate(results):
        assert rank_errors and any(expected in e for e in rank_errors), f"rank {rank}: {rank_errors}"


# -- DCP's plan cache ---------------------------------------------------------------------------------------------


def caching_saves(rank, world_size, root):
    """Three saves through one caching planner, each to its own path. From the second, rank 1's local plan is the
    one it sent the first time (DCP keeps it, naming the first path), but its global plan changes: DCP's
    deduplication moves the replicated ``r`` to it once rank 0 also saves ``b``, which rank 0 alone holds."""
    planner = _PlansForItself(enable_plan_caching=True)
    mesh = init_device_mesh("cpu", (world_size,))
    for step in range(3):
        state = {"b": torch.full((3,), float(step))} if step and rank == 0 else {}
        state["r"] = distribute_tensor(torch.full((4, 2), float(step)), mesh, [Replicate()])
        dcp.save(state, storage_writer=ZarrWriter(os.path.join(root, f"step{step}.zarr")), planner=planner)


@pytest.mark.distributed
def test_a_caching_planner_that_plans_for_itself_saves_a_new_path_every_step(tmp_path):
    run_ranks(caching_saves, 2, str(tmp_path))
    for step in range(3):
        saved = open_checkpoint(str(tmp_path / f"step{step}.zarr")).load_full_state_dict()
        assert torch.equal(saved["r"], torch.full((4, 2), float(step))), step
