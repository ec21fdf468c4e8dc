"""Saves planned locally (ZarrSavePlanner) write the store DCP's own planning writes, with each chunk written once,
and refuse what cannot be planned, naming the keys and ranks (real gloo ranks)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.testing.planners import DCPsPlanning
from tests.support.compare import assert_state_equal
from tests.support.faults import causes
from tests.support.models import build, full_state, load_fresh, save_checkpoint, train_steps
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed]


def save_both_ways(rank, world_size, layout, dcp_path, local_path):
    """Rank program: train, save through DCP's planning and through ZarrSavePlanner; each rank's written keys."""
    model, optim = build(layout, world_size)
    train_steps(model, optim, 2)
    save_checkpoint(model, optim, ZarrWriter(dcp_path), planner=DCPsPlanning())
    writer = ZarrWriter(local_path)
    save_checkpoint(model, optim, writer, planner=ZarrSavePlanner())
    return full_state(model, optim), writer.written_keys


def store_files(path: str) -> dict[str, bytes]:
    found = {}
    for directory, _, files in os.walk(path):
        for name in files:
            full = os.path.join(directory, name)
            with open(full, "rb") as f:
                found[os.path.relpath(full, path).replace(os.sep, "/")] = f.read()
    return found


def without_save_id(root_document: bytes) -> dict:
    document = json.loads(root_document)
    document["attributes"]["dcp_zarr"].pop("save_id")
    return document


@pytest.mark.slow
@pytest.mark.parametrize("layout, world_size", [("fsdp2", 2), ("fsdp2", 3), ("hsdp", 4), ("fsdp_tp", 4),
                                                ("plain", 2)])
def test_the_store_is_the_one_dcp_planning_writes_and_each_chunk_is_written_once(tmp_path, layout, world_size):
    dcp_path, local_path = str(tmp_path / "dcp.zarr"), str(tmp_path / "local.zarr")
    results = run_ranks(save_both_ways, world_size, layout, dcp_path, local_path)
    by_dcp, planned_locally = store_files(dcp_path), store_files(local_path)
    assert sorted(by_dcp) == sorted(planned_locally)
    for name, data in by_dcp.items():
        if name == "zarr.json":
            assert without_save_id(data) == without_save_id(planned_locally[name])
        else:
            assert data == planned_locally[name], name
    keys = [k for _, written in results for k in written]
    assert len(keys) == len(set(keys)), "a chunk was written by two ranks"
    assert {k.split("#")[0] for k in keys} == {n for n in planned_locally if not n.endswith("zarr.json")}
    loaded = run_ranks(load_fresh, 2, "fsdp2", ZarrReader(local_path))[0]
    assert_state_equal(loaded, results[0][0])


def save_differing(rank, world_size, path, kind):
    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)]), "step": torch.tensor(5.0)}
    if kind == "extra key" and rank == 1:
        state["only_on_1"] = torch.full((3,), 7.0)
        state["note_on_1"] = {"text": "rank one"}
    elif kind == "shapes":
        state["x"] = torch.zeros(rank + 1, 2)
    elif kind == "values":
        state["seed"] = {"seed": 1000 + rank}
    elif kind == "two replica patterns":  # on a 2 x 2 mesh: rank 0's replicas are rank 2 for one, rank 1 for the other
        grid = init_device_mesh("cpu", (2, 2))
        state["a"] = distribute_tensor(torch.arange(8.0), grid, [Replicate(), Shard(0)])
        state["b"] = distribute_tensor(torch.arange(8.0) * 2, grid, [Shard(0), Replicate()])
    elif kind == "replicated dtensor values":
        state["r"] = distribute_tensor(torch.ones(4), mesh, [Replicate()])
        state["r"].to_local().fill_(float(rank))
    try:
        dcp.save(state, storage_writer=ZarrWriter(path), planner=ZarrSavePlanner())
    except CheckpointException as exc:
        return [f"{type(cause).__name__}: {cause}" for cause in causes(exc)]
    return None


@pytest.mark.slow
def test_a_key_held_by_some_ranks_only_is_planned_by_an_exchange(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    assert run_ranks(save_differing, 2, path, "extra key") == [None, None]
    target = {"w": torch.zeros(6, 4), "step": torch.tensor(0.0), "only_on_1": torch.zeros(3),
              "note_on_1": {"text": ""}}
    dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
    assert_state_equal(target, {"w": torch.arange(24.0).reshape(6, 4), "step": torch.tensor(5.0),
                                "only_on_1": torch.full((3,), 7.0), "note_on_1": {"text": "rank one"}})


@pytest.mark.slow
def test_replicas_of_two_placements_on_one_mesh_are_compared_within_their_own_holders(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    assert run_ranks(save_differing, 4, path, "two replica patterns") == [None] * 4
    target = {"w": torch.zeros(6, 4), "step": torch.tensor(0.0), "a": torch.zeros(8), "b": torch.zeros(8)}
    dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
    assert torch.equal(target["a"], torch.arange(8.0)) and torch.equal(target["b"], torch.arange(8.0) * 2)


@pytest.mark.slow
def test_one_key_with_two_shapes_is_refused_naming_the_key_and_the_ranks(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    results = run_ranks(save_differing, 2, path, "shapes")
    assert all(results), results
    message = "\n".join(results[0])
    # a plain tensor every rank saves is one replicated entry: refused as DCP's planning refuses replicas that differ
    assert "ReplicaMismatchError" in message and "'x'" in message and "per-rank keys" in message, message
    assert "shape [1, 2] on rank 0" in message and "shape [2, 2] on rank 1" in message, message
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind, key", [("values", "'seed.seed'"), ("replicated dtensor values", "'r'")])
def test_replicas_that_differ_are_refused_before_anything_is_written(tmp_path, kind, key):
    path = str(tmp_path / "ckpt.zarr")
    results = run_ranks(save_differing, 2, path, kind)
    assert all(results), results
    message = "\n".join(results[0])
    assert "ReplicaMismatchError" in message and key in message and "rank 0 vs rank 1" in message, message
    assert "'w'" not in message and "'step'" not in message
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


def save_with_planner_on(rank, world_size, path, subgroup):
    group = dist.new_group([0, 1]) if subgroup else None
    state = {"w": torch.ones(2)}
    try:
        dcp.save(state, storage_writer=ZarrWriter(path), planner=ZarrSavePlanner(process_group=group))
    except CheckpointException as exc:
        return [f"{type(cause).__name__}: {cause}" for cause in causes(exc)]
    return None


@pytest.mark.slow
def test_a_planner_on_another_process_group_is_refused(tmp_path):
    results = run_ranks(save_with_planner_on, 3, str(tmp_path / "ckpt.zarr"), True)
    message = "\n".join(results[0])
    assert "PlanMismatchError" in message and "process_group" in message, message


def test_the_planner_refuses_other_writers(tmp_path):
    with pytest.raises(CheckpointException) as raised:
        dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(str(tmp_path / "fs")),
                 planner=ZarrSavePlanner(), no_dist=True)
    (cause,) = causes(raised.value)
    assert isinstance(cause, TypeError) and "ZarrWriter only" in str(cause)


def save_three_times(rank, world_size, root, planner_kind):
    """Rank program: three saves in a row with DCP's planners, the state changing between them."""
    model, optim = build("fsdp2", world_size)
    states = []
    for step in range(3):
        train_steps(model, optim, 1, first_batch=step)
        planner = {"caching": DefaultSavePlanner(enable_plan_caching=True),
                   "lowest rank": DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                   "subclass": _MegatronLikePlanner(),
                   "local": ZarrSavePlanner()}[planner_kind]
        save_checkpoint(model, optim, ZarrWriter(os.path.join(root, f"step{step}.zarr")), planner=planner)
        states.append(full_state(model, optim))
    return states


class _MegatronLikePlanner(DefaultSavePlanner):
    """Overrides the plan hooks and calls up, as Megatron-core's MCoreSavePlanner and torchtitan's planners do."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.local_items = len(plan.items)
        return plan

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        assert len(metadata.state_dict_metadata) > 0
        return plans, metadata


def load_steps(rank, world_size, root):
    return [load_fresh(rank, world_size, "fsdp2", ZarrReader(os.path.join(root, f"step{s}.zarr"))) for s in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize("planner_kind", ["caching", "lowest rank", "subclass", "local"])
def test_several_saves_in_a_row_with_each_planner_load_back_exactly(tmp_path, planner_kind):
    saved = run_ranks(save_three_times, 2, str(tmp_path), planner_kind)[0]
    loaded = run_ranks(load_steps, 2, str(tmp_path))[0]
    for step in range(3):
        assert_state_equal(loaded[step], saved[step])
    assert sorted(os.listdir(tmp_path)) == ["step0.zarr", "step1.zarr", "step2.zarr"]


def save_on_rank_zero_alone(rank, world_size, root):
    """Rank program: rank 0 saves by itself (no_dist=True) in a job that has a process group."""
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    if rank != 0:
        return None
    plain = {"w": torch.arange(6.0), "steps": {"a": torch.tensor(1.0), "b": torch.tensor(2.0)}, "lr": 0.1}
    dcp.save(plain, storage_writer=ZarrWriter(os.path.join(root, "plain.zarr")), planner=ZarrSavePlanner(),
             no_dist=True)
    try:
        dcp.save({"sharded": sharded}, storage_writer=ZarrWriter(os.path.join(root, "sharded.zarr")),
                 planner=ZarrSavePlanner(), no_dist=True)
    except CheckpointException as exc:
        return [f"{type(cause).__name__}: {cause}" for cause in causes(exc)]
    return None


@pytest.mark.slow
def test_one_rank_saving_alone_saves_everything_or_is_refused(tmp_path):
    refusal = run_ranks(save_on_rank_zero_alone, 2, str(tmp_path))[0]
    target = {"w": torch.zeros(6), "steps": {"a": torch.tensor(0.0), "b": torch.tensor(0.0)}, "lr": 0.0}
    dcp.load(target, storage_reader=ZarrReader(str(tmp_path / "plain.zarr")), no_dist=True)
    assert_state_equal(target, {"w": torch.arange(6.0), "steps": {"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
                                "lr": 0.1})
    assert refusal and "PlanMismatchError" in refusal[0] and "'sharded'" in refusal[0], refusal
    assert not os.path.exists(tmp_path / "sharded.zarr")


def save_pipeline_stages(rank, world_size, path):
    """Rank program: two pipeline stages of two ranks each (a (pp, dp) mesh): each stage's layers are DTensors on
    its own dp slice, with keys the other stage does not have, and a plain step only on stage 0."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    state = {f"layers.{stage}.w": distribute_tensor(torch.arange(20.0).reshape(5, 4) + 100 * stage, mesh["dp"],
                                                    [Shard(0)]),
             "shared": torch.ones(3)}
    if stage == 0:
        state["optim.step"] = torch.tensor(9.0)
    dcp.save(state, storage_writer=ZarrWriter(path), planner=ZarrSavePlanner())
    return rank


@pytest.mark.slow
def test_pipeline_stages_with_their_own_keys_are_planned_by_an_exchange(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    run_ranks(save_pipeline_stages, 4, path)
    target = {"layers.0.w": torch.zeros(5, 4), "layers.1.w": torch.zeros(5, 4), "shared": torch.zeros(3),
              "optim.step": torch.tensor(0.0)}
    dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
    assert_state_equal(target, {"layers.0.w": torch.arange(20.0).reshape(5, 4),
                                "layers.1.w": torch.arange(20.0).reshape(5, 4) + 100, "shared": torch.ones(3),
                                "optim.step": torch.tensor(9.0)})


def save_fsdp1(rank, world_size, dcp_path, local_path):
    """Rank program: an FSDP1 model's SHARDED_STATE_DICT (ShardedTensors), saved both ways."""
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    torch.manual_seed(0)
    model = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)),
                                     device_id=torch.device("cpu"))
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
    kinds = {type(v).__name__ for v in state["model"].values()}
    dcp.save(state, storage_writer=ZarrWriter(dcp_path), planner=DCPsPlanning())
    dcp.save(state, storage_writer=ZarrWriter(local_path), planner=ZarrSavePlanner())
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = {k: v.clone() for k, v in model.state_dict().items()}
    return kinds, full


@pytest.mark.slow
def test_fsdp1_sharded_tensors_save_the_store_dcp_planning_writes(tmp_path):
    dcp_path, local_path = str(tmp_path / "dcp.zarr"), str(tmp_path / "local.zarr")
    kinds, full = run_ranks(save_fsdp1, 2, dcp_path, local_path)[0]
    assert "ShardedTensor" in kinds, kinds
    by_dcp, planned_locally = store_files(dcp_path), store_files(local_path)
    assert sorted(by_dcp) == sorted(planned_locally)
    for name, data in by_dcp.items():
        if name != "zarr.json":
            assert data == planned_locally[name], name
    assert without_save_id(by_dcp["zarr.json"]) == without_save_id(planned_locally["zarr.json"])
    target = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    dcp.load(target, storage_reader=ZarrReader(local_path), no_dist=True)
    assert_state_equal(target["model"], full)
