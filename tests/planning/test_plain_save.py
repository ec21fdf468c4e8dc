"""The line users write, ``dcp.save(sd, storage_writer=ZarrWriter(p))``, is planned locally: ZarrWriter takes over
DCP's own planner in the ``dcp.save`` under way (dcp_zarr/planning/dcp_internals.py), so it writes the store
``ZarrSavePlanner`` writes and DCP's collectives carry the same digests (test_wire_bytes.py counts them). A planner
that plans for itself keeps DCP's protocol; where torch no longer keeps its planner where we look, the save follows
DCP's planning: correct, slower, never wrong."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter, open_checkpoint
from dcp_zarr.planning import dcp_internals
from dcp_zarr.planning.save_planner import rank_plan
from dcp_zarr.testing.planners import DCPsPlanning
from dcp_zarr.torch_private import VERIFIED_TORCH
from tests.support.compare import assert_state_equal
from tests.support.models import build, full_state, load_fresh, save_checkpoint, train_steps
from tests.support.ranks import run_ranks
from tests.support.stores import tree_digest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# The torch releases on which DCP was seen to keep ``planner``, ``distW`` and ``storage_writer`` in
# ``_save_state_dict``'s ``local_step``, where dcp_internals.py looks: the plain line's fast path is expected there.
FAST_PATH_VERIFIED = VERIFIED_TORCH
TAKEN_OVER = {"create_local_plan", "create_global_plan", "finish_plan"}
TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def test_the_plain_line_takes_the_fast_path_on_every_torch_release_verified(tmp_path, monkeypatch):
    """On the releases of FAST_PATH_VERIFIED, DCP's frames are found and the plain line plans locally (DCP's metadata
    comes back empty). On another release this fails the day torch moves them, saying so: the plain line then falls
    back to DCP's planning (correct, slower: test_where_the_planner_is_not_found_the_save_follows_dcps_planning), and
    dcp_internals.py needs another look before the release joins its VERIFIED_TORCH."""
    found = []
    lookup = dcp_internals.dcp_save_call
    monkeypatch.setattr(dcp_internals, "dcp_save_call", lambda: found.append(lookup()) or found[-1])
    planner = DefaultSavePlanner()
    writers = [ZarrWriter(str(tmp_path / "a.zarr")), ZarrWriter(str(tmp_path / "b.zarr"))]
    metadata = [dcp.save({"w": torch.ones(3)}, storage_writer=writers[0], planner=planner),
                dcp.save({"w": torch.ones(3)}, storage_writer=writers[1])]
    fast = None not in found and all(m.state_dict_metadata == {} for m in metadata)
    verified = ", ".join(f"{major}.{minor}" for major, minor in FAST_PATH_VERIFIED)
    assert fast or TORCH_RELEASE in FAST_PATH_VERIFIED, (
        f"torch {torch.__version__} (not one of the releases verified: {verified}) keeps DCP's planner elsewhere: "
        f"the plain line follows DCP's planning, correct and slower; dcp_internals.py needs another look")
    assert fast, f"torch {torch.__version__} was verified to take the fast path, and takes DCP's planning: {found}"
    (given, made) = found
    assert given is not None and given.planner is planner and given.group is None and given.writer is writers[0]
    assert made is not None and type(made.planner) is DefaultSavePlanner and made.writer is writers[1]
    assert vars(planner).keys().isdisjoint(TAKEN_OVER), "given back after the save"


def test_the_plain_line_returns_no_metadata_as_the_planner_does(tmp_path):
    """DCP's Metadata is what its coordinator builds from every rank's items; planned locally there are none (the
    store's manifest is the checkpoint's metadata), so what DCP broadcasts at the end is empty too."""
    state = {"w": torch.arange(6.0), "step": 3, "nested": {"b": torch.ones(2, 2)}}
    metadata = dcp.save(state, storage_writer=ZarrWriter(str(tmp_path / "c.zarr")))
    assert metadata.state_dict_metadata == {}
    assert_state_equal(open_checkpoint(str(tmp_path / "c.zarr")).load_full_state_dict(), state)


@pytest.mark.parametrize("planner", [DefaultSavePlanner(enable_plan_caching=True),
                                     DefaultSavePlanner(dedup_save_to_lowest_rank=True)], ids=["caching", "lowest"])
def test_dcps_own_planners_are_taken_over_save_after_save(tmp_path, planner):
    for step in range(3):
        state = {"w": torch.full((4, 3), float(step)), "step": step}
        metadata = dcp.save(state, storage_writer=ZarrWriter(str(tmp_path / f"{step}.zarr")), planner=planner)
        assert metadata.state_dict_metadata == {}
        assert_state_equal(open_checkpoint(str(tmp_path / f"{step}.zarr")).load_full_state_dict(), state)


def test_a_planner_that_plans_for_itself_keeps_dcps_protocol(tmp_path):
    metadata = dcp.save({"w": torch.ones(5)}, storage_writer=ZarrWriter(str(tmp_path / "s.zarr")),
                        planner=DCPsPlanning())
    assert set(metadata.state_dict_metadata) == {"w"}
    assert dcp_internals.is_dcps_save_planner(DefaultSavePlanner())
    assert not dcp_internals.is_dcps_save_planner(DCPsPlanning())
    override = DefaultSavePlanner()
    override.transform_object = lambda item, obj: obj  # an instance's own hook counts too
    assert not dcp_internals.is_dcps_save_planner(override)


def test_a_planner_left_taken_over_by_a_failed_save_serves_another_writer_as_dcps(tmp_path):
    """A save that fails between the take-over and DCP's finish_plan leaves the instance patched: the next save with
    the same planner and another writer must still get DCP's planning, not the writer's pass-through."""
    planner = DefaultSavePlanner()
    planner.set_up_planner({"w": torch.ones(2)}, is_coordinator=True)
    dcp_internals.take_over_save(dcp_internals.SaveCall(planner, None, ZarrWriter(str(tmp_path / "never.zarr"))),
                                 rank_plan)
    fs = str(tmp_path / "fs")
    metadata = dcp.save({"w": torch.full((2,), 7.0)}, storage_writer=dcp.FileSystemWriter(fs), planner=planner)
    assert set(metadata.state_dict_metadata) == {"w"} and "create_global_plan" not in vars(planner)
    back = {"w": torch.zeros(2)}
    dcp.load(back, storage_reader=dcp.FileSystemReader(fs))
    assert torch.equal(back["w"], torch.full((2,), 7.0))


def test_a_writer_kept_across_saves_does_not_keep_the_last_state_dict(tmp_path):
    """The local plan holds DCP's planner, and so the state dict: a writer (store= mode keeps one) lets it go."""
    writer = ZarrWriter(str(tmp_path / "kept.zarr"))
    tensor = torch.ones(4, 3)
    watch = weakref.ref(tensor)
    dcp.save({"w": tensor}, storage_writer=writer)
    del tensor
    gc.collect()
    assert watch() is None, "the saved tensor is still referenced after the save"


# -- real ranks --------------------------------------------------------------------------------------------------


def save_planning_apart(rank, world_size, path, layout):
    """Rank program: rank 0 with DCP's own planner (planned locally), the others with one that plans for itself."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if layout == "plain":
        state = {"w": torch.arange(12.0).reshape(4, 3)}
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        state = {"w": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)], src_data_rank=None)}
    try:
        dcp.save(state, storage_writer=ZarrWriter(path), planner=DefaultSavePlanner() if rank == 0 else DCPsPlanning())
    except BaseException as exc:  # DCP raises on every rank what the coordinator raised (a CheckpointException)
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["plain", "dtensor"])
def test_ranks_that_plan_apart_are_refused_by_name(tmp_path, layout):
    path = str(tmp_path / "apart.zarr")
    errors = run_ranks(save_planning_apart, 2, path, layout)
    assert all(e and "PlanMismatchError" in e and "rank 0 planned this save locally" in e
               and "rank 1 through a planner that plans for itself" in e for e in errors), errors
    assert not os.path.exists(path) and not os.path.exists(tmp_path / ".dcp-zarr-staging"), "nothing was written"




def save_plain_and_planned(rank, world_size, layout, plain_path, planned_path, dcp_path):
    """Rank program: the same state saved by the plain line, by ZarrSavePlanner and by DCP's planning."""
    model, optim = build(layout, world_size)
    train_steps(model, optim, 2)
    save_checkpoint(model, optim, ZarrWriter(plain_path))
    save_checkpoint(model, optim, ZarrWriter(planned_path), planner=ZarrSavePlanner())
    save_checkpoint(model, optim, ZarrWriter(dcp_path), planner=DCPsPlanning())
    return full_state(model, optim)


def _without_save_ids(path: str) -> dict:
    import json

    digest = tree_digest(path)
    with open(f"{path}/zarr.json") as f:
        root = json.load(f)
    root["attributes"]["dcp_zarr"].pop("save_id")
    digest["zarr.json"] = json.dumps(root, sort_keys=True)
    return digest


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout, world_size", [("fsdp2", 2), ("fsdp2", 3), ("hsdp", 4), ("fsdp_tp", 4)])
def test_one_layout_whoever_plans(tmp_path, layout, world_size):
    """The plain line, ZarrSavePlanner and a planner that keeps DCP's planning write the same store, byte for byte
    (but the save's id): its loads are as fast whichever way it was saved."""
    paths = [str(tmp_path / name) for name in ("plain.zarr", "planned.zarr", "dcp.zarr")]
    state = run_ranks(save_plain_and_planned, world_size, layout, *paths)[0]
    plain, planned, by_dcp = (_without_save_ids(p) for p in paths)
    assert plain == planned
    assert by_dcp == planned
    assert_state_equal(run_ranks(load_fresh, 2, "fsdp2", ZarrReader(paths[0]))[0], state)


def save_plain_where_torch_moved_things(rank, world_size, path, moved):
    import warnings

    from dcp_zarr.errors import UnverifiedTorchWarning

    if moved:  # as if torch kept its planner in a function of another name
        dcp_internals._SAVE = dcp_internals._SAVE._replace(step="moved_local_step")
    model, optim = build("fsdp2", world_size)
    train_steps(model, optim, 1)
    msd, osd = get_state_dict(model, optim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metadata = dcp.save({"model": msd, "optim": osd}, storage_writer=ZarrWriter(path))
    said = sum(issubclass(w.category, UnverifiedTorchWarning) for w in caught)
    return full_state(model, optim), len(metadata.state_dict_metadata), said


@pytest.mark.distributed
@pytest.mark.slow
def test_where_the_planner_is_not_found_the_save_follows_dcps_planning(tmp_path):
    fallback, found = str(tmp_path / "fallback.zarr"), str(tmp_path / "found.zarr")
    (state, entries, said), _ = run_ranks(save_plain_where_torch_moved_things, 2, fallback, True)
    assert entries > 0, "DCP planned it: its metadata lists every entry"
    assert said == 1, "and the rank said so"
    (_, none, unsaid), _ = run_ranks(save_plain_where_torch_moved_things, 2, found, False)
    assert none == 0 and unsaid == 0
    assert_state_equal(open_checkpoint(fallback).load_full_state_dict(), state)
    assert _without_save_ids(fallback) == _without_save_ids(found), "the same store either way"


def async_plain(rank, world_size, path, executor):
    """Rank program: the plain line in dcp.async_save, on a gloo group of its own (thread) or in DCP's process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(37 * 5, dtype=torch.float32).reshape(37, 5)
    state = {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]), "b": torch.ones(3), "step": 4}
    if executor == "thread":
        group = dist.new_group(backend="gloo")
        future = dcp.async_save(state, storage_writer=ZarrWriter(path), process_group=group,
                                async_checkpointer_type=AsyncCheckpointerType.THREAD)
    else:
        future = dcp.async_save(state, storage_writer=ZarrWriter(path),
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    state["w"].to_local().add_(1)  # the save works from its staged copy
    if executor == "thread":
        dist.all_reduce(torch.ones(1))  # the training's own collective meanwhile, on the default group
    metadata = future.result()
    return {"w": full, "b": torch.ones(3), "step": 4}, len(metadata.state_dict_metadata)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_the_plain_line_in_async_saves(tmp_path, executor):
    path = str(tmp_path / "a.zarr")
    (expected, entries), _ = run_ranks(async_plain, 2, path, executor, timeout=240)
    assert entries == 0, "planned locally"
    assert_state_equal(open_checkpoint(path).load_full_state_dict(), expected)
