"""A rank planning alone derives each array's chunk grid from its placements: exactly the grid that every rank's
boxes give (format/chunk_layout.chunk_layout_for_boxes on DCP's deduplicated boxes), and who holds which box."""

from __future__ import annotations

import itertools

import pytest
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from dcp_zarr.errors import InvalidEntryError
from dcp_zarr.format.chunk_layout import array_shard_layout, chunk_layout_for_boxes
from dcp_zarr.placement.box_writers import balanced, box_holders
from dcp_zarr.placement.boxes import dtensor_local_box, strided_split_factor
from dcp_zarr.placement.chunk_grids import box_at, dtensor_boxes, dtensor_layout
from dcp_zarr.placement.holdings import Mesh, MeshSlice

MESHES = [(1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2)]
PLACEMENT_CHOICES = [Replicate(), Shard(0), Shard(1), Partial()]


def boxes_of_every_rank(size, mesh_shape, placements):
    """Every rank's box as DTensor computes it: what DCP's plans hold, duplicates and all."""
    return [_compute_local_shape_and_global_offset(size, mesh_shape, list(c), placements)[::-1]
            for c in itertools.product(*(range(n) for n in mesh_shape))]


def expected(size, mesh_shape, placements, array_shards):
    boxes = sorted({(tuple(o), tuple(s)) for o, s in boxes_of_every_rank(size, mesh_shape, placements)})
    layout = chunk_layout_for_boxes(size, boxes, 4, 64)
    if array_shards:
        layout = array_shard_layout(layout, boxes) or layout
    return layout, sum(1 for _, s in boxes if all(s))


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("array_shards", [False, True])
def test_the_grid_from_placements_is_the_grid_of_every_rank_s_boxes(mesh_shape, array_shards):
    checked = 0
    for placements in itertools.product(PLACEMENT_CHOICES, repeat=len(mesh_shape)):
        for size in [(), (0,), (1,), (5,), (7, 3), (8, 1), (3, 10), (0, 4), (9, 6), (16, 16)]:
            if any(isinstance(p, Shard) and p.dim >= len(size) for p in placements):
                continue
            placements = tuple(placements)
            found = dtensor_layout(size, mesh_shape, placements, 4, 64, array_shards)
            assert found == expected(size, mesh_shape, placements, array_shards), (size, mesh_shape, placements)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3), (3, 2), (4, 2), (3, 4), (2, 2, 2)])
def test_strided_shards_and_a_dim_split_several_times_in_closed_form_as_enumerated(mesh_shape):
    """FSDP2 over TP: (_StridedShard(0, split_factor=tp), Shard(0)) on (dp, tp); a dim split by two plain Shards;
    and a split factor that is not the next mesh dim's size (enumerated)."""
    *outer, tp = mesh_shape
    layouts = [(_StridedShard(0, split_factor=tp), Shard(0)), (Shard(0), Shard(0)), (Shard(0), Shard(1)),
               (_StridedShard(0, split_factor=tp + 1), Shard(0))]
    for size in [(18, 4), (17, 6), (5, 5), (0, 3), (1, 2), (64, 3), (37, 9)]:
        for placements in layouts:
            placements = (Replicate(),) * (len(outer) - 1) + placements
            for array_shards in (False, True):
                found = dtensor_layout(size, mesh_shape, placements, 4, 64, array_shards)
                assert found == expected(size, mesh_shape, placements, array_shards), (size, placements)
            assert dtensor_boxes(size, mesh_shape, placements) == sorted(
                {(tuple(o), tuple(s)) for o, s in boxes_of_every_rank(size, mesh_shape, placements)})


def test_the_holders_of_a_box_are_the_ranks_that_hold_it_on_every_slice_of_the_root_mesh():
    """FSDP over dp of a (dp, tp) mesh: rank r's mesh is the dp slice through it; ranks r and r' on other tp slices
    at the same dp coordinate hold the same box of a DTensor not split over tp, and nothing else does."""
    root = Mesh.of((2, 3), [10, 11, 12, 13, 14, 15])  # dp x tp, ranks not numbered from 0
    dp_slices = {r: [10 + (r - 10) % 3, 13 + (r - 10) % 3] for r in root.ranks}  # the dp slice through r
    for rank, ranks in dp_slices.items():
        mesh = MeshSlice.of(root, (2,), ranks)
        assert mesh.coordinate(rank) == ((rank - 10) // 3,)
        same_dp = [r for r in root.ranks if (r - 10) // 3 == (rank - 10) // 3]
        assert sorted(box_holders(mesh, (Shard(0),), rank)) == same_dp
        assert sorted(box_holders(mesh, (Replicate(),), rank)) == list(root.ranks)
        assert mesh.slice_ranks(rank) == ranks
    tokens = {MeshSlice.of(root, (2,), ranks).token for ranks in dp_slices.values()}
    assert len(tokens) == 1, "every slice of one kind has one token: the ranks' digests agree"


def test_balanced_takes_the_largest_first_to_the_least_loaded():
    assert balanced([("a", 1), ("b", 5), ("c", 5), ("d", 2)], 2) == {"b": 0, "c": 1, "d": 0, "a": 1}
    assert balanced([("a", 1), ("b", 9)], 8) == {"b": 0, "a": 1}


def test_a_mesh_that_is_its_own_root_plans_as_the_slice_covering_it():
    root = Mesh.of((2, 3), [10, 11, 12, 13, 14, 15])
    whole, sliced = MeshSlice.of_root(root), MeshSlice.of(root, (2, 3), list(root.ranks))
    for rank in root.ranks:
        assert whole.coordinate(rank) == sliced.coordinate(rank)
        assert whole.slice_ranks(rank) == sliced.slice_ranks(rank)
        for placements in [(Replicate(), Shard(0)), (Shard(0), Replicate()), (Shard(0), Shard(1))]:
            assert box_holders(whole, placements, rank) == box_holders(sliced, placements, rank)


BOX_PLACEMENTS = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(0, split_factor=3),
                  _StridedShard(1, split_factor=2)]


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2), (2, 3), (3, 2), (4, 2), (2, 2, 2)])
def test_each_rank_s_box_in_arithmetic_is_the_box_torch_computes(mesh_shape):
    """boxes.dtensor_local_box at every coordinate, against torch's index tensors: plain and strided shards in any
    order, a dim split several times, uneven and empty pieces; Partial is left to torch (None)."""
    checked = 0
    for placements in itertools.product(BOX_PLACEMENTS, repeat=len(mesh_shape)):
        for size in [(0, 3), (1, 2), (5, 5), (7, 1), (17, 6), (18, 4), (37, 9), (64, 3)]:
            for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
                sizes, offsets = _compute_local_shape_and_global_offset(size, mesh_shape, list(coordinate), placements)
                found = dtensor_local_box(size, mesh_shape, placements, coordinate)
                assert found == (tuple(offsets), tuple(sizes)), (size, mesh_shape, placements, coordinate)
                checked += 1
    assert checked >= 96
    assert dtensor_local_box((4,), (2,), (Partial(),), (0,)) is None


def test_torch_s_strided_shard_is_told_by_what_it_says_of_itself():
    """dcp_zarr imports no private torch name outside planning/dcp_internals.py: torch's _StridedShard is told by
    its public methods and attributes. Every other placement has no split factor."""
    assert strided_split_factor(_StridedShard(1, split_factor=3)) == 3
    for placement in (Shard(0), Shard(1), Replicate(), Partial()):
        assert strided_split_factor(placement) is None


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2), (3, 2)])
def test_a_partial_placement_holds_the_whole_dim_as_torch_says(mesh_shape):
    """box_at, which enumerations of every rank's box call, places a Partial as torch does (a load target may be
    one), with no private torch function."""
    for placements in itertools.product([Partial(), Replicate(), Shard(0), Shard(1)], repeat=len(mesh_shape)):
        if not any(p.is_partial() for p in placements):
            continue
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            sizes, offsets = _compute_local_shape_and_global_offset((7, 5), mesh_shape, list(coordinate), placements)
            assert box_at((7, 5), mesh_shape, placements, coordinate) == (tuple(offsets), tuple(sizes))


def test_a_placement_dcp_zarr_does_not_know_is_refused_naming_it():
    class Diagonal(Placement):  # a placement a later torch might add
        def __str__(self) -> str:
            return "Diagonal()"

        def __hash__(self) -> int:
            return 1

        def __eq__(self, other) -> bool:
            return isinstance(other, Diagonal)

    with pytest.raises(InvalidEntryError, match=r"Diagonal\(\).*pip install -U dcp-zarr"):
        box_at((4, 4), (2,), (Diagonal(),), (0,))


@pytest.mark.parametrize("m", [5, 16, 37])
def test_strided_grid_at_many_ranks_in_closed_form_as_enumerated(m):
    """(_StridedShard(0, split_factor=k), Shard(0)) on a (m, k) mesh: the grid computed from a few ranks per run of
    like ranks is the grid of every rank's box as DTensor computes it, sizes leaving pieces partial and empty."""
    for k in (2, 3, 8):
        for n in (1, 7, 40, 63, 64, 100, 257, 1001):
            placements = (_StridedShard(0, split_factor=k), Shard(0))
            found = dtensor_layout((n, 3), (m, k), placements, 4, 64, False)
            assert found == expected((n, 3), (m, k), placements, False), (n, m, k)


def test_the_planner_s_write_items_are_dcp_s_on_every_rank():
    """ZarrSavePlanner's items (boxes in arithmetic) against DCP's create_default_local_save_plan on each rank of an
    8-rank (2, 4) mesh on torch's fake process group: FSDP2-over-TP's strided shards, HSDP, 2-D shards, uneven and
    empty pieces, a plain tensor and a value; a Partial DTensor is refused by both alike."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dcp_zarr.planning.save_planner import local_write_items

    layouts = [(_StridedShard(0, split_factor=4), Shard(0)), (Replicate(), Shard(0)), (Shard(0), Shard(1)),
               (Shard(1), Shard(0)), (Shard(0), Shard(0))]
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            mesh = init_device_mesh("cpu", (2, 4))
            state: dict = {"plain": torch.zeros(3), "value": {"epoch": 2}}
            for i, placements in enumerate(layouts):
                for size in [(37, 9), (6, 3), (2, 2), (64, 16)]:
                    local = torch.zeros(1, dtype=torch.bfloat16, device="meta")  # the box comes from the placements
                    stride = (size[1], 1)
                    state[f"t{i}.{size}"] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                               shape=torch.Size(size), stride=stride)
            assert local_write_items(state) == create_default_local_save_plan(state, rank == 0).items, rank
            partial = {"p": DTensor.from_local(torch.zeros(2), mesh, (Partial(), Shard(0)), run_check=False)}
            with pytest.raises(ValueError, match="partial"):
                create_default_local_save_plan(partial, True)
            with pytest.raises(ValueError, match="partial"):
                local_write_items(partial)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_the_planner_s_items_hold_the_properties_of_each_rank_s_local_shard_as_dcp_s(grad_enabled):
    """The items' TensorProperties are DCP's, made from each rank's local tensor (``to_local()``): its dtype, pinning,
    whether it requires grad (as the DTensor does where grad is enabled, as the local tensor does where not), and from
    torch 2.15 its strides, contiguous or not (a transposed local shard), whatever the global tensor's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dcp_zarr.planning.save_planner import local_write_items

    layouts = [(Shard(0), Shard(1)), (Replicate(), Shard(1)), (_StridedShard(0, split_factor=4), Shard(0))]
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            mesh = init_device_mesh("cpu", (2, 4))
            state: dict = {"plain": torch.zeros(5, 3).t()}
            for i, placements in enumerate(layouts):
                for size in [(37, 9), (6, 3), (2, 2)]:
                    box = _compute_local_shape_and_global_offset(size, (2, 4), list(mesh.get_coordinate()),
                                                                 placements)[0]
                    for kind, local in (("rows", torch.zeros(box)), ("columns", torch.zeros(box[::-1]).t()),
                                        ("grad", torch.zeros(box, dtype=torch.bfloat16))):
                        state[f"{kind}{i}.{size}"] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                                         shape=torch.Size(size), stride=(size[1], 1))
                    state[f"grad{i}.{size}"].requires_grad_()  # the DTensor, not its local tensor
            with torch.set_grad_enabled(grad_enabled):
                ours, dcps = local_write_items(state), create_default_local_save_plan(state, rank == 0).items
            assert ours == dcps, rank
            properties = {item.index.fqn: item.tensor_data.properties for item in ours if item.tensor_data}
            assert {fqn for fqn, p in properties.items() if p.requires_grad} == (
                {fqn for fqn in state if fqn.startswith("grad")} if grad_enabled else set())
            if hasattr(properties["plain"], "strides"):  # torch 2.15
                assert {fqn: p.strides for fqn, p in properties.items()} == {
                    fqn: (t.to_local() if isinstance(t, DTensor) else t).stride() for fqn, t in state.items()}
        finally:
            dist.destroy_process_group()
