"""One rank's part of a locally planned save, from the writer's side.

``LocalSave`` is made in ``ZarrWriter.prepare_local_plan`` from the planner's ``RankState``: the rank's entries,
their nodes (checked), its ``Summary`` (what DCP gathers in place of the plan) and the checksums of its replicated
entries. In ``write_data`` it turns the coordinator's ``Ticket`` into what the write path takes, as for a save DCP
plans (the items this rank writes and a ``RankAssignment``); on the coordinator it then gives ``finish`` every
array's spec.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict, defaultdict

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_zarr.collective.aggregation import Aggregation, plan_aggregation
from dcp_zarr.errors import PlanMismatchError
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.compression import BloscCodec, Compression
from dcp_zarr.format.torch_arrays import numpy_dtype, torch_dtype_name
from dcp_zarr.placement.box_writers import Decisions, box_holders, rank_decisions, replica_group
from dcp_zarr.placement.chunk_grids import entry_layout
from dcp_zarr.placement.holdings import (
    DTENSOR,
    EVERY_RANK,
    TENSOR,
    Holding,
    Merged,
    group_rank_of,
    rank_entries,
    structure_digest,
)
from dcp_zarr.planning import replicas
from dcp_zarr.planning.compression_sample import poorly_compressed
from dcp_zarr.planning.dcp_internals import sharded_tensor_type
from dcp_zarr.planning.dcp_plans import RankAssignment, array_spec, checked_node_paths
from dcp_zarr.planning.exchange import exchange_entries, merge
from dcp_zarr.planning.protocol import Summary, Ticket
from dcp_zarr.planning.save_planner import RankState


class LocalSave:
    """One rank's locally planned save (the module's docstring says when each part runs)."""

    def __init__(self, state: RankState, rank: int | None, coordinator: bool, check_replicas: str,
                 replica_check_bytes: int, aggregate_below: int = 0, exchange_bytes: int = 256 << 20,
                 inner_chunk_bytes: int | None = None, compression: Compression | None = None):
        group = state.group
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = rank if rank is not None else (dist.get_rank(group) if distributed else 0)
        self.coordinator = coordinator
        group_rank = group_rank_of(group) if distributed else int
        self.entries, self.items = rank_entries(state.items, state.state_dict, state.mappings, self.rank, group_rank,
                                                 sharded_tensor_type())
        for entry in self.entries.values():
            if entry.dtype is not None:
                numpy_dtype(entry.dtype)  # raises naming the dtype if unsupported
        self.key_order = list(state.mappings) or list(self.entries)
        digest = structure_digest(self.entries.values())
        nodes_key = ("nodes", digest)
        self.nodes = _recent_plans.get(nodes_key) or _recent_plans.put(
            nodes_key, checked_node_paths((fqn, e.path) for fqn, e in self.entries.items()))
        self.planner = state.planner
        self.check_replicas = check_replicas
        self.checksums = self._replica_checksums(check_replicas, replica_check_bytes)
        group_digests = tuple(sorted((group_name, _digest_of(sums)) for group_name, sums in self.checksums.items()))
        self.compression = compression
        # compressed arrays: every candidate but those some rank's sample found not to compress (the Ticket's)
        self.stored_plain: frozenset[str] = frozenset()
        options = (inner_chunk_bytes, aggregate_below, exchange_bytes,  # protocol.SAVE_OPTIONS, checked alike
                   None if compression is None else compression.key())
        poor = frozenset() if compression is None else poorly_compressed(
            ((fqn, e.dtype, e.nbytes) for fqn, e in self.entries.items() if e.kind == TENSOR and e.dtype is not None),
            self._local_tensor, compression)
        self.summary = Summary(self.rank, self.world_size, digest, group_digests, options, poor)
        self.merged: Merged | None = None  # the plan of an exchange (ranks that differ)
        self._merged_nodes: dict[str, str] | None = None
        # collective/: arrays held in pieces smaller than this are written by aggregators, in rounds of at most
        # exchange_bytes a rank
        self.aggregate_below = aggregate_below
        self.exchange_bytes = exchange_bytes
        self._merged_aggregation: Aggregation | None = None

    def plan_alone(self) -> None:
        """DCP saves on this rank alone (``no_dist=True`` in a job with a process group, or a group of one): plan for
        a world of one, unless an entry has parts on other ranks, which this save would leave out."""
        if self.world_size == 1:
            return
        elsewhere = sorted(fqn for fqn, e in self.entries.items()
                           if (e.holding == DTENSOR and e.mesh is not None and len(e.mesh.root.ranks) > 1)
                           or any(r != self.rank for _, _, r in e.boxes))
        if elsewhere:
            listed = ", ".join(map(repr, elsewhere[:8])) + (f" and {len(elsewhere) - 8} more" if len(elsewhere) > 8
                                                             else "")
            raise PlanMismatchError(
                f"dcp.save runs on one rank, but {len(elsewhere)} entries have parts on other ranks ({listed}): "
                "they would be saved incomplete. Save them on every rank of their mesh, or save a full state dict")
        self.world_size, self.rank = 1, 0
        self.summary = self.summary._replace(rank=0, world_size=1)

    def _local_tensor(self, fqn: str) -> torch.Tensor | None:
        """This rank's data of a tensor entry (its first non-empty box), for a compression sample."""
        for item in self.items.get(fqn, ()):
            data = item.tensor_data
            if data is not None and all(data.chunk.sizes):
                value = self.planner.resolve_data(item)
                return value if isinstance(value, torch.Tensor) else None
        return None

    # -- replicas ----------------------------------------------------------------------------------------------------

    def _replicated(self) -> dict[MetadataIndex, tuple[str, WriteItem]]:
        """Each item of this rank that other ranks hold too, with the name of the group holding it."""
        found = {}
        for fqn, entry in self.entries.items():
            if entry.holding == EVERY_RANK and self.world_size > 1:
                name = replica_group(entry, self.rank)
            elif entry.holding == DTENSOR and len(box_holders(entry.mesh, entry.placements, self.rank)) > 1:
                name = replica_group(entry, self.rank)
            else:
                continue
            for item in self.items[fqn]:
                found[item.index] = (name, item)
        return found

    def _replica_checksums(self, mode: str, max_bytes: int) -> dict[str, dict[MetadataIndex, str]]:
        """group -> {item index: checksum} of the replicated items ``mode`` compares (replicas.py's modes)."""
        sums: dict[str, dict[MetadataIndex, str]] = defaultdict(dict)
        if mode == replicas.NONE:
            return sums
        for index, (name, item) in self._replicated().items():
            if mode == replicas.ALL or item.type == WriteItemType.BYTE_IO or _item_nbytes(item) <= max_bytes:
                sums[name][index] = replicas.value_checksum(item, self.planner)
        return sums

    def reported_checksums(self, ticket: Ticket) -> dict[MetadataIndex, str]:
        """The per-item checksums the coordinator asked for (replica groups that disagreed; all on an exchange)."""
        return {index: digest for name, sums in self.checksums.items()
                if ticket.exchange or name in ticket.detail_groups for index, digest in sums.items()}

    # -- the plan ----------------------------------------------------------------------------------------------------

    def rank_writes(self, ticket: Ticket, inner_chunk_bytes: int, array_shards: bool
                    ) -> tuple[list[WriteItem], RankAssignment]:
        """The items this rank writes and its RankAssignment, as DCP's coordinator path would have sent them (the
        arrays its aggregators write left out: ``aggregation``)."""
        self.stored_plain = ticket.stored_plain
        if ticket.exchange:
            self.merged = merge(exchange_entries(self.entries, self.rank, self.world_size, self.group),
                                keep_first_replica=self.check_replicas == replicas.NONE)
            decisions = self._aggregated(self._decisions_after_exchange(self.merged), inner_chunk_bytes)
            items = self._items_written(decisions)
            specs = self.array_specs(inner_chunk_bytes, array_shards,
                                     {i.index.fqn for i in items} | decisions.describes)
        else:
            # The structure every rank agreed on decides the plan: reused while it stays the same (the digest)
            key = ("rank", self.summary.digest, self.rank, self.coordinator, self.world_size, inner_chunk_bytes,
                   array_shards, self.aggregate_below, self.exchange_bytes, self.compression, self.stored_plain)
            reused = _recent_plans.get(key)
            if reused is None:
                box_nbytes = {fqn: _item_nbytes(items[0]) for fqn, items in self.items.items()}
                decisions = rank_decisions(self.entries, self.rank, self.world_size, box_nbytes, self.coordinator)
                decisions = self._aggregated(decisions, inner_chunk_bytes)
                fqns = {fqn for fqn in self.items if fqn in decisions.writes} | decisions.describes
                reused = _recent_plans.put(key, (decisions, self.array_specs(inner_chunk_bytes, array_shards, fqns)))
            decisions, specs = reused
            items = self._items_written(decisions)
        assignment = RankAssignment(
            staging_location=ticket.staging_location,
            arrays=specs,
            nodes={i.index.fqn: self.nodes[i.index.fqn] for i in items if i.type == WriteItemType.BYTE_IO},
            describes=frozenset(f for f in decisions.describes if f in specs),
        )
        return items, assignment

    def aggregation(self, inner_chunk_bytes: int) -> Aggregation:
        """The save's aggregated arrays and the rounds of their blocks (collective/aggregation.py), alike on every
        rank; reused while the structure stays the same."""
        if self.merged is not None:
            if self._merged_aggregation is None:
                self._merged_aggregation = plan_aggregation(self.merged.entries, self.world_size, self.aggregate_below,
                                                            inner_chunk_bytes, self.exchange_bytes, self.merged)
            return self._merged_aggregation
        key = ("aggregation", self.summary.digest, self.world_size, self.aggregate_below, inner_chunk_bytes,
               self.exchange_bytes)
        return _recent_plans.get(key) or _recent_plans.put(key, plan_aggregation(
            self.entries, self.world_size, self.aggregate_below, inner_chunk_bytes, self.exchange_bytes))

    def _aggregated(self, decisions: Decisions, inner_chunk_bytes: int) -> Decisions:
        """``decisions`` without the aggregated arrays' boxes, which their aggregators write; each aggregated
        array's zarr.json is written by the aggregator of its first block."""
        arrays = self.aggregation(inner_chunk_bytes).arrays
        if not arrays:
            return decisions
        writes = frozenset(w for w in decisions.writes if (w if isinstance(w, str) else w.fqn) not in arrays)
        describes = frozenset(f for f in decisions.describes if f not in arrays)
        return Decisions(writes, describes | {f for f, a in arrays.items() if a.aggregators[0] == self.rank})

    def held_pieces(self, planner, inner_chunk_bytes: int) -> dict[str, list]:
        """fqn -> [(box, data)] of this rank's non-empty boxes of every aggregated array (its items' data)."""
        arrays = self.aggregation(inner_chunk_bytes).arrays
        held: dict[str, list] = {}
        for fqn in arrays:
            for item in self.items.get(fqn, ()):
                data = item.tensor_data
                if data is None or not all(data.chunk.sizes):
                    continue
                box = (tuple(data.chunk.offsets), tuple(data.chunk.sizes))
                held.setdefault(fqn, []).append((box, planner.resolve_data(item)))
        return held

    def _items_written(self, decisions: Decisions) -> list[WriteItem]:
        return [item for fqn, held in self.items.items() for item in held
                if fqn in decisions.writes or item.index in decisions.writes]

    def saved_arrays(self, inner_chunk_bytes: int, array_shards: bool) -> tuple[dict[str, ArraySpec], dict[str, int]]:
        """(fqn -> ArraySpec, fqn -> non-empty boxes saved) of every array of the save, for the coordinator's
        manifest; reused while the structure stays the same."""
        key = ("save", self.summary.digest, inner_chunk_bytes, array_shards, self.world_size, self.aggregate_below,
               self.exchange_bytes, self.compression, self.stored_plain)
        reused = None if self.merged is not None else _recent_plans.get(key)
        if reused is None:
            specs = self.array_specs(inner_chunk_bytes, array_shards)
            entries = self.global_entries()
            shards = {fqn: self.layout(entries[fqn], inner_chunk_bytes, array_shards)[1] for fqn in specs}
            reused = (specs, shards) if self.merged is not None else _recent_plans.put(key, (specs, shards))
        return reused

    def _decisions_after_exchange(self, merged: Merged) -> Decisions:
        writes = frozenset(index for index, rank in merged.writers.items() if rank == self.rank)
        return Decisions(writes, frozenset(fqn for fqn, rank in merged.describers.items() if rank == self.rank))

    def global_entries(self) -> dict[str, Holding]:
        """Every entry of the save (the coordinator's own, unless an exchange merged every rank's)."""
        return self.merged.entries if self.merged is not None else self.entries

    def global_key_order(self) -> list[str]:
        if self.merged is None:
            return self.key_order
        return self.key_order + [fqn for fqn in self.merged.entries if fqn not in set(self.key_order)]

    def global_nodes(self) -> dict[str, str]:
        """fqn -> node of every entry of the save, checked for collisions (once, after an exchange)."""
        if self.merged is None:
            return self.nodes
        if self._merged_nodes is None:
            self._merged_nodes = checked_node_paths((f, e.path) for f, e in self.merged.entries.items())
        return self._merged_nodes

    def array_specs(self, inner_chunk_bytes: int, array_shards: bool, fqns=None) -> dict[str, ArraySpec]:
        """fqn -> ArraySpec of the tensor entries named (default: all of the save's)."""
        entries = self.global_entries()
        nodes = self.global_nodes()
        shared: dict[ChunkLayout, ChunkLayout] = {}  # one layout object per shape, as array_specs_for_plans keeps
        specs = {}
        for fqn in (entries if fqns is None else fqns):
            entry = entries[fqn]
            if entry.kind != TENSOR:
                continue
            assert entry.dtype is not None  # a tensor entry
            layout, _ = self.layout(entry, inner_chunk_bytes, array_shards)
            specs[fqn] = array_spec(fqn, nodes[fqn], entry.dtype, shared.setdefault(layout, layout))
        return specs

    def layout(self, entry: Holding, inner_chunk_bytes: int, array_shards: bool) -> tuple[ChunkLayout, int]:
        """(the array's layout, its count of non-empty boxes saved)."""
        boxes = self.merged.boxes.get(entry.fqn) if self.merged is not None else None
        assert entry.dtype is not None  # a tensor entry
        codec = self.codec(entry)
        # compressed inner chunks have no sizes known in advance, so ranks cannot write them into one shard file
        layout, count = entry_layout(entry, entry.dtype.itemsize, inner_chunk_bytes, array_shards and codec is None,
                                     boxes)
        aggregated = self.aggregation(inner_chunk_bytes).arrays.get(entry.fqn)
        return (layout if aggregated is None else aggregated.layout).compressed(codec), count

    def codec(self, entry: Holding) -> BloscCodec | None:
        """The codec of a tensor entry's array: with compression, for candidates no rank's sample refused."""
        compression = self.compression
        if compression is None or entry.dtype is None or entry.fqn in self.stored_plain:
            return None
        if not compression.compresses(torch_dtype_name(entry.dtype), entry.nbytes):
            return None
        return compression.codec(entry.dtype.itemsize)


class _RecentPlans:
    """The last few plans this process made, by what decides them: a job saving one state dict every few minutes
    plans once, and after a restart once again, without any exchange (the digests say the structure is the same)."""

    def __init__(self, size: int = 8):
        self._plans: OrderedDict = OrderedDict()
        self._size = size
        self._lock = threading.Lock()  # async saves plan on DCP's background thread

    def get(self, key):
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def put(self, key, plan):
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan


_recent_plans = _RecentPlans()


def _item_nbytes(item: WriteItem) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


def _digest_of(sums: dict[MetadataIndex, str]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for index in sorted(sums, key=lambda i: (i.fqn, tuple(i.offset or ()))):
        digest.update(f"{index.fqn}|{list(index.offset or ())}|{sums[index]}\n".encode())
    return digest.hexdigest()

