"""A load's read items in arithmetic (planning/load_plan.py): the items DCP's own planning makes, on every rank of
several meshes; DCP's own planner taken over in a plain ``dcp.load``, once, and left alone where it is not DCP's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dcp_zarr import ZarrLoadPlanner, ZarrReader, ZarrWriter
from dcp_zarr.planning import dcp_internals, load_plan
from dcp_zarr.planning.load_plan import local_read_items
from tests.support.compare import assert_state_equal
from tests.support.faults import causes
from tests.support.models import build, full_state, load_checkpoint, save_checkpoint, train_steps
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LAYOUTS = [(_StridedShard(0, split_factor=4), Shard(0)), (Replicate(), Shard(0)), (Shard(0), Shard(1)),
           (Shard(1), Shard(0)), (Shard(0), Shard(0)), (Replicate(), Replicate())]
SIZES = [(37, 9), (6, 3), (2, 2), (64, 16), (1, 5), (0, 4)]


def _whole(size, dtype=torch.float32) -> TensorStorageMetadata:
    """A tensor as ZarrReader presents it: one saved chunk, the global array."""
    shape = torch.Size(size)
    return TensorStorageMetadata(TensorProperties(dtype=dtype), shape,
                                 [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)])


def _same_items(state: dict, metadata: Metadata, strict: bool = True) -> None:
    ours = local_read_items(state, metadata, strict)
    dcps = create_default_local_load_plan(state, metadata, strict).items
    assert ours == dcps
    # MetadataIndex leaves .index out of its equality: DCP's resolve_tensor and our reads use it
    assert [(i.dest_index.index, i.storage_index.index) for i in ours] == \
           [(i.dest_index.index, i.storage_index.index) for i in dcps]


def test_the_read_items_are_dcps_on_every_rank_of_several_meshes():
    """On each rank of an 8-rank (2, 4) mesh on torch's fake process group: FSDP2-over-TP's strided shards, HSDP,
    2-D shards, uneven, empty and replicated pieces, a DTensor on a mesh the rank is not in, plain tensors, a
    Parameter, a 0-dim tensor, values, an entry saved in DCP's own chunks, keys not asked for and keys not saved."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            mesh = init_device_mesh("cpu", (2, 4))
            some = DeviceMesh("cpu", [0, 1, 2], _init_backend=False)  # ranks 3-7 are not in it
            state: dict = {"plain": torch.zeros(3), "param": torch.nn.Parameter(torch.zeros(2, 5)),
                           "scalar": torch.tensor(2.0), "empty": torch.zeros(0, 3), "value": 7,
                           "in_chunks": torch.zeros(8, 2), "not_saved": torch.zeros(1)}
            saved: dict = {"plain": _whole((3,)), "param": _whole((2, 5)), "scalar": _whole(()),
                           "empty": _whole((0, 3)), "value": BytesStorageMetadata(), "unasked": _whole((4,)),
                           "in_chunks": TensorStorageMetadata(TensorProperties(), torch.Size((8, 2)), [
                               ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((5, 2))),
                               ChunkStorageMetadata(torch.Size((5, 0)), torch.Size((3, 2)))])}
            for i, placements in enumerate(LAYOUTS):
                for size in SIZES:
                    local = torch.zeros(1, device="meta")  # the box comes from the placements
                    state[f"t{i}.{size}"] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                               shape=torch.Size(size), stride=(size[1], 1))
                    saved[f"t{i}.{size}"] = _whole(size)
            state["elsewhere"] = DTensor.from_local(torch.zeros(2), some, (Shard(0),), run_check=False,
                                                    shape=torch.Size((6,)), stride=(1,))
            saved["elsewhere"] = _whole((6,))
            metadata = Metadata(saved)
            _same_items({k: v for k, v in state.items() if k != "not_saved"}, metadata)
            _same_items(state, metadata, strict=False)
        finally:
            dist.destroy_process_group()


def test_dcps_errors_are_dcps():
    metadata = Metadata({"w": _whole((3, 4))})
    for state, error, match in [({"missing": torch.zeros(1)}, RuntimeError, "Missing key in checkpoint state_dict"),
                                ({"w": torch.zeros(4, 3)}, ValueError, "Size mismatch between saved")]:
        with pytest.raises(error, match=match) as ours:
            local_read_items(state, metadata)
        with pytest.raises(error) as dcps:
            create_default_local_load_plan(state, metadata, True)
        assert str(ours.value) == str(dcps.value)


def test_a_partial_dtensor_is_refused_as_dcp_refuses_it():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        partial = DTensor.from_local(torch.zeros(2), init_device_mesh("cpu", (2,)), (Partial(),), run_check=False)
        metadata = Metadata({"p": _whole((2,))})
        with pytest.raises(ValueError) as ours:
            local_read_items({"p": partial}, metadata)
        with pytest.raises(ValueError) as dcps:
            create_default_local_load_plan({"p": partial}, metadata, True)
        assert str(ours.value) == str(dcps.value) and "partial" in str(ours.value.__cause__)
    finally:
        dist.destroy_process_group()


def test_keys_flattened_as_torch_2_3_did_are_left_to_dcps_own_check():
    """Saved keys not asked for: DCP checks whether they are the state dict's keys in torch 2.3's flattening
    (a dict without tensors kept whole), and then plans in that form itself."""
    original = {"w": torch.zeros(1), "meta": {"milestones": [10, 20]}}
    assert dcp_internals._may_be_of_torch_2_3(original, {"meta"})  # torch 2.3 saved it whole; now "meta.milestones"
    assert not dcp_internals._may_be_of_torch_2_3(original, {"optim.state.w.step"})


def _count_dcps_planning(monkeypatch) -> list:
    calls: list = []
    own = default_planner.create_default_local_load_plan
    monkeypatch.setattr(default_planner, "create_default_local_load_plan",
                        lambda *args, **kwargs: calls.append(args[0].keys()) or own(*args, **kwargs))
    return calls


def test_dcps_own_planner_is_taken_over_for_one_plan(tmp_path, monkeypatch):
    """Fails the day torch moves ``planner`` out of ``_load_state_dict``'s ``local_step``, or calls the reader's
    ``set_up_storage_reader`` elsewhere: the load is then planned by DCP, correct and slower."""
    path = str(tmp_path / "s.zarr")
    state = {"w": torch.arange(12.0).reshape(3, 4), "nested": {"b": torch.ones(2)}, "step": 5}
    dcp.save(state, storage_writer=ZarrWriter(path))
    calls = _count_dcps_planning(monkeypatch)
    planner = DefaultLoadPlanner()
    target = {"w": torch.zeros(3, 4), "nested": {"b": torch.zeros(2)}, "step": 0}
    dcp.load(target, storage_reader=ZarrReader(path), planner=planner)
    assert_state_equal(target, state)
    assert calls == []
    assert "create_local_plan" not in vars(planner), "given back after one plan"
    part = {"w": torch.zeros(3, 4)}  # a part of the checkpoint: DCP's check of torch 2.3's form says no
    dcp.load(part, storage_reader=ZarrReader(path))
    assert calls == [] and torch.equal(part["w"], state["w"])
    more = {"w": torch.zeros(3, 4), "new": torch.full((2,), 7.0)}  # a key the checkpoint lacks, allowed
    dcp.load(more, storage_reader=ZarrReader(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert calls == [] and torch.equal(more["w"], state["w"]) and torch.equal(more["new"], torch.full((2,), 7.0))
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: new"):
        dcp.load(more, storage_reader=ZarrReader(path))


class OwnPlanning(DefaultLoadPlanner):
    def create_local_plan(self):
        plan = super().create_local_plan()
        self.planned = len(plan.items)
        return plan


def test_a_planner_that_plans_for_itself_plans_as_it_says(tmp_path, monkeypatch):
    path = str(tmp_path / "s.zarr")
    dcp.save({"w": torch.ones(4)}, storage_writer=ZarrWriter(path))
    calls = _count_dcps_planning(monkeypatch)
    planner, target = OwnPlanning(), {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=ZarrReader(path), planner=planner)
    assert planner.planned == 1 and len(calls) == 1 and torch.equal(target["w"], torch.ones(4))


def test_where_the_planner_is_not_found_dcp_plans_the_load(tmp_path, monkeypatch):
    path = str(tmp_path / "s.zarr")
    dcp.save({"w": torch.ones(4)}, storage_writer=ZarrWriter(path))
    calls = _count_dcps_planning(monkeypatch)
    monkeypatch.setattr(dcp_internals, "dcp_load_planner", lambda: None)  # as if torch kept it elsewhere
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=ZarrReader(path))
    assert len(calls) == 1 and torch.equal(target["w"], torch.ones(4))


def save_then_load_planned_both_ways(rank, world_size, path, layout):
    """Rank program: a trained model and optimizer saved; loaded at another mesh with DCP's planner taken over and
    with ZarrLoadPlanner, each counted against DCP's own planning."""
    model, optim = build(layout, world_size)
    train_steps(model, optim, 2)
    save_checkpoint(model, optim, ZarrWriter(path))
    expected = full_state(model, optim)
    calls: list = []
    own = default_planner.create_default_local_load_plan
    default_planner.create_default_local_load_plan = lambda *a, **k: calls.append(1) or own(*a, **k)
    results = []
    for planner in (None, ZarrLoadPlanner()):
        fresh, fresh_optim = build("fsdp2" if layout != "fsdp2" else "plain", world_size, seed=1)
        train_steps(fresh, fresh_optim, 1)
        load_checkpoint(fresh, fresh_optim, ZarrReader(path), planner)
        results.append(full_state(fresh, fresh_optim))
    return expected, results, len(calls)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2", "plain"])
def test_a_trained_model_loads_bit_exact_at_another_layout_without_dcps_planning(tmp_path, layout):
    (expected, results, calls), (_, _, other_calls) = run_ranks(save_then_load_planned_both_ways, 2,
                                                               str(tmp_path / "m.zarr"), layout)
    for loaded in results:
        assert_state_equal(loaded, expected)
    assert calls == other_calls == 0


def test_the_destinations_are_the_tensors_dcps_resolve_tensor_gives():
    """Read into the very memory DCP's ``resolve_tensor`` gives (same storage, offset, shape, strides), for DTensors
    (whole local shards, empty ones, replicas), plain tensors, a Parameter and a 0-dim tensor; a planner with its own
    ``resolve_tensor`` is asked."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dcp_zarr.placement.boxes import dtensor_local_box

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 4))
        state: dict = {"plain": torch.zeros(3), "param": torch.nn.Parameter(torch.zeros(2, 5)),
                       "scalar": torch.tensor(2.0)}
        for i, placements in enumerate(LAYOUTS):
            for size in SIZES:
                box = dtensor_local_box(size, (2, 4), placements, (1, 1))
                assert box is not None
                state[f"t{i}.{size}"] = DTensor.from_local(torch.zeros(box[1]), mesh, placements, run_check=False,
                                                           shape=torch.Size(size), stride=(size[1], 1))
        metadata = Metadata({key: _whole(value.shape) for key, value in state.items()})
        for planner in (DefaultLoadPlanner(), ZarrLoadPlanner(), OwnResolving()):
            planner.set_up_planner(state, metadata)
            destination = load_plan.destinations(planner)
            for item in local_read_items(state, metadata):
                ours, dcps = destination(item), planner.resolve_tensor(item).detach()
                assert (ours.untyped_storage().data_ptr(), ours.storage_offset(), ours.shape, ours.stride()) == \
                       (dcps.untyped_storage().data_ptr(), dcps.storage_offset(), dcps.shape, dcps.stride()), item
                assert not ours.requires_grad
        assert OwnResolving.asked == len(local_read_items(state, metadata)) * 2
    finally:
        dist.destroy_process_group()


class OwnResolving(DefaultLoadPlanner):
    asked = 0

    def resolve_tensor(self, read_item):
        type(self).asked += 1
        return super().resolve_tensor(read_item)


def test_a_take_over_left_by_a_load_that_failed_plans_the_next_one_as_dcp():
    """A load that failed between the reader's set-up and DCP's plan (a reader's subclass raising after it) leaves
    the planner taken over; set up again with other metadata, it plans as DCP's own would."""
    state = {"w": torch.zeros(8)}
    first = Metadata({"w": _whole((8,))})
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, first)
    assert dcp_internals.take_over_load(planner, first, local_read_items)
    saved_in_two = Metadata({"w": TensorStorageMetadata(TensorProperties(), torch.Size((8,)), [
        ChunkStorageMetadata(torch.Size((0,)), torch.Size((4,))),
        ChunkStorageMetadata(torch.Size((4,)), torch.Size((4,)))])})
    planner.set_up_planner(state, saved_in_two)
    assert planner.create_local_plan().items == create_default_local_load_plan(state, saved_in_two).items
    assert "create_local_plan" not in vars(planner)


def _saying_its_own_boxes(tensor: torch.Tensor) -> torch.Tensor:
    """torch 2.14's CheckpointableTensor: elements 2..5 of ``tensor`` are elements 4..7 of a tensor of 16."""
    tensor.global_shape = (16,)
    tensor.global_offsets, tensor.local_offsets, tensor.local_sizes = ((4,),), ((2,),), ((4,),)
    return tensor


def test_tensors_that_say_their_own_boxes_are_dcps_to_plan_and_resolve():
    """Items and destinations of a tensor carrying torch 2.14's CheckpointableTensor attributes are DCP's own (on
    torch 2.14 a box of the global tensor; on earlier torch the tensor whole), whatever its buffer's size."""
    for size in (8, 16):
        state = {"w": _saying_its_own_boxes(torch.zeros(size))}
        metadata = Metadata({"w": _whole((size,))})  # a metadata that fits the buffer: for DCP's earlier torch
        try:
            dcps = create_default_local_load_plan(state, metadata, True).items
        except ValueError as exc:  # torch 2.14 checks the global shape
            with pytest.raises(ValueError) as ours:
                local_read_items(state, metadata)
            assert str(ours.value) == str(exc)
            continue
        assert local_read_items(state, metadata) == dcps
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, metadata)
        for item in dcps:
            ours, theirs = load_plan.destinations(planner)(item), planner.resolve_tensor(item).detach()
            assert (ours.data_ptr(), ours.shape) == (theirs.data_ptr(), theirs.shape)


@pytest.mark.parametrize("planner", [None, "dcps"], ids=["plain", "dcp-planned"])
def test_a_save_refuses_a_tensor_that_says_its_own_boxes_by_name(tmp_path, planner):
    from dcp_zarr.errors import InvalidEntryError
    from dcp_zarr.testing.planners import DCPsPlanning

    path = tmp_path / "s.zarr"
    with pytest.raises(CheckpointException) as raised:
        dcp.save({"ok": torch.ones(2), "w": _saying_its_own_boxes(torch.arange(8.0))},
                 storage_writer=ZarrWriter(str(path)), planner=DCPsPlanning() if planner else None)
    found = causes(raised.value)
    assert any(isinstance(e, InvalidEntryError) and "'w'" in str(e) and "global_shape" in str(e) for e in found), \
        found
    assert not path.exists(), "nothing written"
