"""One rank's part of a locally planned save, from the writer's side: the steps that read the plan's pieces.

Made in ``ZarrWriter.prepare_local_plan`` from the planner's ``RankState``: the rank's part (``rank_part.py``,
gathered once), the checksums of its replicated entries (``replica_sums.py``), and its ``Summary``, what DCP gathers
in place of the plan (with compression, the arrays whose sample did not compress: ``compression_sample.py``). In
``write_data`` the coordinator's ``Ticket`` gives the rest of the plan's inputs (an exchange when the ranks differed:
``exchange.py``), and ``write_plan.py`` the plan, from which come what the write path takes, as for a save DCP plans
(the items this rank writes and a ``RankAssignment``), and on the coordinator every array's spec.
"""

from __future__ import annotations

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_zarr.placement.holdings import TENSOR, Holding
from dcp_zarr.planning import replicas
from dcp_zarr.planning.assignments import RankAssignment
from dcp_zarr.planning.compression_sample import poorly_compressed
from dcp_zarr.planning.exchange import exchange_entries, merge
from dcp_zarr.planning.protocol import PlanOptions, Summary, Ticket
from dcp_zarr.planning.rank_part import alone, gather_part
from dcp_zarr.planning.replica_sums import group_digests, replica_checksums, reported_checksums
from dcp_zarr.planning.save_planner import RankState
from dcp_zarr.planning.write_plan import WritePlan, plan_for


class RankPlanning:
    """One rank's locally planned save (the module's docstring says when each part runs)."""

    def __init__(self, state: RankState, rank: int | None, coordinator: bool, check_replicas: str,
                 replica_check_bytes: int, options: PlanOptions):
        self.part = part = gather_part(state, rank, coordinator)
        self.check_replicas = check_replicas
        self.options = options
        self.checksums = replica_checksums(part, check_replicas, replica_check_bytes)
        compression = options.compression
        poor = frozenset() if compression is None else poorly_compressed(
            ((fqn, e.dtype, e.nbytes) for fqn, e in part.entries.items() if e.kind == TENSOR and e.dtype is not None),
            part.local_tensor, compression)
        self.summary = Summary(part.rank, part.world_size, part.digest, group_digests(self.checksums),
                               options.summarized(), poor)
        self.plan: WritePlan | None = None  # from the Ticket, in rank_writes

    @property
    def group(self):
        return self.part.group

    def plan_alone(self) -> None:
        """DCP saves on this rank alone: plan for a world of one (rank_part.alone says when that is refused)."""
        self.part = alone(self.part)
        self.summary = self.summary._replace(rank=self.part.rank, world_size=self.part.world_size)

    def reported_checksums(self, ticket: Ticket) -> dict[MetadataIndex, str]:
        return reported_checksums(self.checksums, ticket)

    def rank_writes(self, ticket: Ticket, array_shards: bool) -> tuple[list[WriteItem], RankAssignment]:
        """The items this rank writes and its RankAssignment, as DCP's coordinator path would have sent them (the
        arrays its aggregators write left out), from this save's plan, made here."""
        part = self.part
        merged = None
        if ticket.exchange:
            merged = merge(exchange_entries(part.entries, part.rank, part.world_size, part.group),
                           keep_first_replica=self.check_replicas == replicas.NONE)
        self.plan = plan = plan_for(part, self.options, array_shards, ticket.stored_plain, merged)
        items = plan.items_written(part)
        assignment = RankAssignment(
            staging_location=ticket.staging_location,
            arrays=plan.specs,
            nodes={i.index.fqn: part.nodes[i.index.fqn] for i in items if i.type == WriteItemType.BYTE_IO},
            describes=frozenset(f for f in plan.decisions.describes if f in plan.specs),
        )
        return items, assignment

    def save_entries(self) -> dict[str, Holding]:
        """Every entry of this save, as this save holds them: the rank's own, or every rank's after an exchange."""
        merged = self.plan.merged if self.plan is not None else None
        return merged.entries if merged is not None else self.part.entries

    def save_key_order(self) -> list[str]:
        """This save's state dict's key order (DCP's planner_data), which numbers a flat optimizer's params; after
        an exchange, the keys only other ranks hold follow."""
        merged = self.plan.merged if self.plan is not None else None
        key_order = self.part.key_order
        if merged is None:
            return key_order
        return key_order + [fqn for fqn in merged.entries if fqn not in set(key_order)]

    def held_pieces(self, planner) -> dict[str, list]:
        """fqn -> [(box, data)] of this rank's non-empty boxes of every aggregated array (its items' data)."""
        assert self.plan is not None, "held_pieces before rank_writes"
        held: dict[str, list] = {}
        for fqn in self.plan.aggregation.arrays:
            for item in self.part.items.get(fqn, ()):
                data = item.tensor_data
                if data is None or not all(data.chunk.sizes):
                    continue
                box = (tuple(data.chunk.offsets), tuple(data.chunk.sizes))
                held.setdefault(fqn, []).append((box, planner.resolve_data(item)))
        return held
