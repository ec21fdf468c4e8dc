"""A locally planned save's plan, as a value: one function (``make_plan``) of the save's entries, its world and the
writer's options, alike on every rank, kept in ``recent_plans`` under one frozen key (``PlanKey``) naming every
input. When the ranks' digests differed, the exchange's plan (``Merged``, planning/exchange.py) is one more input,
and such a plan is not kept: the next save's exchange may find other entries.

What it decides: the arrays aggregated (collective/aggregation.py), who writes what (placement/box_writers.py, the
one place that decides it), each array's layout and codec, and on the coordinator every array's spec for the
manifest.
"""

from __future__ import annotations

import dataclasses

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.planner import WriteItem

from dcp_zarr.collective.aggregation import Aggregation, plan_aggregation
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.codecs import Codec
from dcp_zarr.format.torch_arrays import torch_dtype_name
from dcp_zarr.placement.box_writers import Decisions, exchange_decisions, rank_decisions, without_aggregated
from dcp_zarr.placement.chunk_grids import entry_layout
from dcp_zarr.placement.holdings import TENSOR, Holding, Merged
from dcp_zarr.planning.assignments import array_spec, checked_node_paths
from dcp_zarr.planning.protocol import PlanOptions
from dcp_zarr.planning.rank_part import RankPart
from dcp_zarr.planning.recent_plans import recent_plans


@dataclasses.dataclass(frozen=True)
class PlanKey:
    """Every input of ``make_plan`` besides the entries, which ``digest`` stands for."""

    digest: str  # the structure every rank agreed on
    rank: int
    world_size: int
    coordinator: bool  # writes every value, and makes the manifest's specs
    options: PlanOptions
    array_shards: bool  # the storage writes at offsets: ranks' row blocks of an array fill one shard file
    stored_plain: frozenset[str]  # arrays some rank's compression sample refused (the Ticket's)


@dataclasses.dataclass(frozen=True, eq=False)
class WritePlan:
    """What the save's structure and options decide. Not the entries themselves: the key stands for their structure,
    not for what each save reads of them anew (the state dict's key order, each tensor's source), which the save
    takes from its own part (``RankPlanning.save_entries``, ``save_key_order``)."""

    nodes: dict[str, str]  # fqn -> zarr node of every entry of the save
    merged: Merged | None  # the exchange's plan, when the ranks differed
    aggregation: Aggregation
    decisions: Decisions  # this rank's writes and descriptions
    specs: dict[str, ArraySpec]  # of the arrays this rank writes items of or describes
    aggregated_specs: dict[str, ArraySpec]  # of the arrays aggregated
    saved_specs: dict[str, ArraySpec] | None  # the coordinator's: every array's, for the manifest
    saved_shards: dict[str, int] | None  # the coordinator's: every array's count of non-empty boxes saved

    def items_written(self, part: RankPart) -> list[WriteItem]:
        """This rank's items that it writes (the save's own objects: never kept with the plan)."""
        writes = self.decisions.writes
        return [item for fqn, held in part.items.items() for item in held
                if fqn in writes or item.index in writes]


def plan_for(part: RankPart, options: PlanOptions, array_shards: bool, stored_plain: frozenset[str],
             merged: Merged | None = None) -> WritePlan:
    """The save's plan on this rank: reused while its key is the same (never after an exchange)."""
    key = PlanKey(part.digest, part.rank, part.world_size, part.coordinator, options, array_shards, stored_plain)
    if merged is not None:
        return make_plan(part, key, merged)
    return recent_plans.made(key, lambda: make_plan(part, key, None))


def make_plan(part: RankPart, key: PlanKey, merged: Merged | None) -> WritePlan:
    options = key.options
    if merged is None:
        entries, nodes = part.entries, part.nodes
    else:
        entries = merged.entries
        nodes = checked_node_paths((f, e.path) for f, e in entries.items())
    aggregation = plan_aggregation(entries, key.world_size, options.aggregate_below, options.inner_chunk_bytes,
                                   options.exchange_bytes, merged)
    if merged is None:
        decisions = rank_decisions(entries, key.rank, key.world_size, part.box_nbytes(), key.coordinator)
    else:
        decisions = exchange_decisions(merged, key.rank)
    decisions = without_aggregated(decisions, {f: a.aggregators[0] for f, a in aggregation.arrays.items()}, key.rank)
    layouts = _Layouts(key, aggregation, merged)
    written = {fqn for fqn, held in part.items.items() for item in held
               if fqn in decisions.writes or item.index in decisions.writes}
    specs = layouts.specs(entries, nodes, written | decisions.describes)
    saved_specs = saved_shards = None
    if key.coordinator:
        saved_specs = layouts.specs(entries, nodes, entries)
        saved_shards = {fqn: layouts.layout(entries[fqn], nodes[fqn])[1] for fqn in saved_specs}
    return WritePlan(nodes, merged, aggregation, decisions, specs,
                     layouts.specs(entries, nodes, aggregation.arrays), saved_specs, saved_shards)


class _Layouts:
    """Each array's layout and codec, under one plan's inputs."""

    def __init__(self, key: PlanKey, aggregation: Aggregation, merged: Merged | None):
        self.key, self.aggregation, self.merged = key, aggregation, merged

    def specs(self, entries: dict[str, Holding], nodes: dict[str, str], fqns) -> dict[str, ArraySpec]:
        """fqn -> ArraySpec of the tensor entries named."""
        shared: dict[ChunkLayout, ChunkLayout] = {}  # one layout object per shape, as array_specs_for_plans keeps
        specs = {}
        for fqn in fqns:
            entry = entries[fqn]
            if entry.kind != TENSOR:
                continue
            assert entry.dtype is not None  # a tensor entry
            layout, _ = self.layout(entry, nodes[fqn])
            specs[fqn] = array_spec(fqn, nodes[fqn], entry.dtype, shared.setdefault(layout, layout))
        return specs

    def layout(self, entry: Holding, node: str) -> tuple[ChunkLayout, int]:
        """(the array's layout, its count of non-empty boxes saved). In a save that records its chunks, one object
        per chunk, but for the arrays that changed whole or not at all in the earlier one
        (``PlanOptions.whole_arrays``)."""
        boxes = self.merged.boxes.get(entry.fqn) if self.merged is not None else None
        assert entry.dtype is not None  # a tensor entry
        codec = self.codec(entry)
        # compressed inner chunks have no sizes known in advance, so ranks cannot write them into one shard file
        records = self.key.options.records_chunks
        layout, count = entry_layout(entry, entry.dtype.itemsize, self.key.options.inner_chunk_bytes,
                                     self.key.array_shards and codec is None and not records, boxes)
        if records:
            layout = layout.recorded(whole=node in self.key.options.whole_arrays)
        aggregated = self.aggregation.arrays.get(entry.fqn)
        return (layout if aggregated is None else aggregated.layout).compressed(codec), count

    def codec(self, entry: Holding) -> Codec | None:
        """The codec of a tensor entry's array: with compression, for candidates no rank's sample refused."""
        compression = self.key.options.compression
        if compression is None or entry.dtype is None or entry.fqn in self.key.stored_plain:
            return None
        if not compression.compresses(torch_dtype_name(entry.dtype), entry.nbytes):
            return None
        return compression.codec(entry.dtype.itemsize)
