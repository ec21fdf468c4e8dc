"""The coordinator's per-save decisions in a save DCP plans (planning/assignments.py, placement/box_writers.py): who
writes each array's metadata, and the layouts sent."""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcp_zarr.placement.box_writers import describing_ranks
from dcp_zarr.planning.assignments import array_specs_for_plans, assignments, node_paths


def _row_block(fqn: str, rows: int, rank: int, world: int) -> WriteItem:
    """Rank ``rank``'s row block of a (rows, 4) fp32 tensor split evenly over ``world`` ranks (FSDP Shard(0))."""
    step = rows // world
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size([rank * step, 0])), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([rank * step, 0]), torch.Size([step, 4])),
                                    properties=TensorProperties(dtype=torch.float32), size=torch.Size([rows, 4])))


def _plans(fqns_by_rank: list[list[str]], world: int) -> list[SavePlan]:
    return [SavePlan([_row_block(f, 8 * world, rank, world) for f in fqns]) for rank, fqns in enumerate(fqns_by_rank)]


def _describers(plans: list[SavePlan]) -> dict[str, int]:
    specs = array_specs_for_plans(plans, node_paths(plans), 1 << 20)
    return describing_ranks(([item.index.fqn for item in plan.items] for plan in plans), specs)


def test_arrays_every_rank_holds_are_described_evenly_by_all_ranks():
    """FSDP: every rank holds a row block of every array; the first holder (rank 0) used to write all metadata."""
    fqns = [f"layers.{i}.weight" for i in range(100)]
    world = 4
    chosen = _describers(_plans([fqns] * world, world))

    assert set(chosen) == set(fqns)
    assert sorted(list(chosen.values()).count(r) for r in range(world)) == [25, 25, 25, 25]


def test_an_array_is_described_by_a_rank_that_holds_part_of_it():
    plans = _plans([["a", "b"], ["b", "c"], ["c"]], 3)
    chosen = _describers(plans)

    assert chosen["a"] == 0 and chosen["b"] in (0, 1) and chosen["c"] in (1, 2)
    held = {rank: {item.index.fqn for item in plan.items} for rank, plan in enumerate(plans)}
    assert all(fqn in held[rank] for fqn, rank in chosen.items())


def test_each_array_is_described_by_exactly_one_rank_assignment():
    plans = _plans([[f"t{i}" for i in range(10)]] * 2, 2)
    nodes = node_paths(plans)
    specs = array_specs_for_plans(plans, nodes, 1 << 20)
    result = assignments(plans, specs, nodes, "staging", [(), ()])

    described = [fqn for assignment in result for fqn in assignment.describes]
    assert sorted(described) == sorted(specs) and len(result[0].describes) == len(result[1].describes) == 5


def test_arrays_of_one_shape_share_one_layout_and_pickle_it_once():
    world = 2
    plans = _plans([["a", "b"], ["a", "b"]], world)
    plans[0].items.append(_row_block("c", 16 * world, 0, world))  # another shape: its own layout
    specs = array_specs_for_plans(plans, node_paths(plans), 1 << 20, array_shards=True)

    assert specs["a"].layout is specs["b"].layout
    assert specs["c"].layout != specs["a"].layout
    unpickled = pickle.loads(pickle.dumps(specs))
    assert unpickled["a"].layout is unpickled["b"].layout, "a rank's plan holds one copy of a shared layout"
