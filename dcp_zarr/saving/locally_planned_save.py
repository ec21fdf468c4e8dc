"""A save planned on every rank (DCP's own planner taken over, or ``ZarrSavePlanner``): DCP carries the writer's
messages (planning/protocol.py) in place of plans and write results.

``local_plan``: the rank's part (planning/rank_planning.py) and its ``Summary``. ``global_plans`` (the coordinator):
the summaries checked, the save begun, a ``Ticket`` for every rank. ``write``: the rank's chunks, its aggregated
blocks (collective/), one ``RankReport``. ``finish`` (the coordinator): the manifest from its own plan and the
reports, then the commit.
"""

from __future__ import annotations

import dataclasses

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from dcp_zarr.collective.aggregated_writes import write_aggregated
from dcp_zarr.collective.transfer import Group
from dcp_zarr.format.manifest import Entry
from dcp_zarr.planning.protocol import REPORT_FQN, PlanOptions, RankReport, Ticket, check_summaries
from dcp_zarr.planning.rank_planning import RankPlanning
from dcp_zarr.planning.save_planner import RankState
from dcp_zarr.saving import coordinator, incremental
from dcp_zarr.saving.item_writes import checked_tensor, write_items
from dcp_zarr.saving.settings import SaveSettings
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.chunk_reuse import ChunkReuse, ReuseCounts


class LocallyPlannedSave:
    def __init__(self, settings: SaveSettings, state: RankState, rank: int | None, is_coordinator: bool):
        self.settings = settings
        self.is_coordinator = is_coordinator
        # This rank's part: it holds the planner, and so the state dict, so the save is dropped with it.
        self.earlier = incremental.open_earlier(settings)  # before anything is written
        options = PlanOptions(settings.inner_chunk_bytes, settings.aggregate_below_bytes(), settings.block_bytes(),
                              settings.compression, settings.incremental, incremental.whole_arrays(self.earlier))
        self.local = RankPlanning(state, rank, is_coordinator, settings.check_replicas, settings.replica_check_bytes,
                               options)
        self.written_keys: list[str] = []
        self._begun: coordinator.Begun | None = None  # the coordinator's, from global_plans
        self._detail_groups: frozenset[str] = frozenset()  # replica groups whose digests differed (protocol.py)
        self._own_report: RankReport | None = None  # the coordinator's own values and object sizes (not sent)
        self.reuse_counts: ReuseCounts | None = None  # this rank's, in a save that records its chunks

    def local_plan(self, plan: SavePlan) -> SavePlan:
        """What DCP gathers in place of ``plan`` (whose planner_data made this save): the rank's Summary."""
        # planner_data={}: what DCP's own planner, taken over, merges into its (empty) metadata
        return SavePlan(items=[], storage_data=self.local.summary, planner_data={})

    def global_plans(self, plans: list[SavePlan]) -> list[SavePlan]:
        summaries = [plan.storage_data for plan in plans]
        if len(plans) == 1:
            self.local.plan_alone()
            summaries = [self.local.summary]
        exchange, self._detail_groups = check_summaries(summaries)
        self._begun = begun = coordinator.begin(self.settings, len(plans))
        stored_plain = frozenset().union(*(summary.poorly_compressed for summary in summaries))
        ticket = Ticket(begun.save_id, begun.staging_location, exchange, self._detail_groups, stored_plain)
        return [dataclasses.replace(plan, storage_data=ticket) for plan in plans]

    def write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """This rank's part, and the one WriteResult that reports it (protocol.py)."""
        ticket = plan.storage_data
        assert isinstance(ticket, Ticket), f"a save planned locally was sent {type(ticket).__name__}"
        local, settings = self.local, self.settings
        checksums = local.reported_checksums(ticket)
        values, objects, fills = {}, {}, {}
        nbytes = 0
        chunks = None
        stored = ReuseCounts(0, 0, 0, 0)
        if not ticket.detail_groups:  # replicas that disagree: their checksums, for finish's error; nothing written
            storage = settings.open(ticket.staging_location)
            items, assignment = local.rank_writes(ticket, storage.writes_at_offsets)
            reuse = ChunkReuse(self.earlier) if settings.incremental else None
            aggregated_keys, aggregated_bytes = self._write_aggregated(storage, planner, reuse)
            results, chunk_keys, stored = write_items(storage, items, assignment, planner, settings.thread_count,
                                                      with_sources=False, reuse=reuse)
            if reuse is None:  # else its counts, in stored, hold the aggregated blocks too
                stored = stored._replace(written_chunks=stored.written_chunks + len(aggregated_keys),
                                         written_bytes=stored.written_bytes + aggregated_bytes)
            if reuse is not None:
                chunks = incremental.ChunkReport.of(reuse)
                self.reuse_counts = chunks.counts
            for result in results:
                nbytes += result.size_in_bytes
                if "value" in result.storage_data:
                    values[result.index.fqn] = result.storage_data["value"]
                elif "object_nbytes" in result.storage_data:
                    objects[result.index.fqn] = result.storage_data["object_nbytes"]
                elif "fill" in result.storage_data:
                    fills[result.index.fqn] = result.storage_data["fill"]
            self.written_keys = aggregated_keys + chunk_keys
        if self.is_coordinator:  # kept here for finish: DCP pads every rank's gathered results to the largest
            self._own_report = RankReport(values, objects, {}, chunks, stored, fills)
            values, objects, chunks, fills = {}, {}, None, {}
        report = RankReport(values, objects, checksums, chunks, stored, fills or None)
        return [WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=nbytes, storage_data=report)]

    def _write_aggregated(self, storage: Storage, planner: SavePlanner, reuse: ChunkReuse | None
                          ) -> tuple[list[str], int]:
        """The blocks of the arrays aggregated in this save (collective/): every rank of the save takes part in
        every round, on the planner's process group, which is the one DCP saves on (check_summaries): for
        dcp.async_save, the background save's own group, whose collectives nothing else interleaves with. In a save
        that records its chunks each block goes through ``reuse``, linked where it is unchanged."""
        local = self.local
        plan = local.plan
        assert plan is not None  # rank_writes made it
        if not plan.aggregation.arrays:
            return [], 0

        def held() -> dict:  # called inside the exchange, so that a tensor that cannot be saved fails every rank
            return {fqn: [(box, checked_tensor(tensor, fqn)) for box, tensor in boxes]
                    for fqn, boxes in local.held_pieces(planner).items()}

        return write_aggregated(plan.aggregation, local.save_entries(), plan.aggregated_specs, held, Group(local.group),
                                storage, self.settings.thread_count, plan.merged, reuse)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The manifest, from the coordinator's own plan and each rank's one report, then the commit (``metadata``,
        DCP's, is empty: the manifest is the checkpoint's metadata)."""
        begun, local = self._begun, self.local
        assert begun is not None, "finish of a save without its prepare_global_plan"
        reports: list[RankReport] = [r.storage_data for rank_results in results for r in rank_results
                                     if r.index.fqn == REPORT_FQN]
        coordinator.refuse_differing_replicas(begun, [report.checksums for report in reports], self._detail_groups)
        own = self._own_report or RankReport({}, {}, {}, None)
        values = dict(own.values)
        values.update((fqn, v) for report in reports for fqn, v in report.values.items())
        objects = dict(own.objects)
        objects.update((fqn, n) for report in reports for fqn, n in report.objects.items())
        fills = {fqn: v for report in (own, *reports) for fqn, v in (report.fills or {}).items()}
        plan = local.plan
        assert plan is not None and plan.saved_specs is not None and plan.saved_shards is not None  # the coordinator's
        specs, saved_shards = plan.saved_specs, plan.saved_shards
        entries: dict[str, Entry] = {}
        for fqn, entry in local.save_entries().items():
            if fqn in specs:
                entries[fqn] = coordinator.tensor_entry(specs[fqn], entry.path, entry.size, entry.requires_grad,
                                                        saved_shards[fqn], entry.source, fills.get(fqn))
            else:
                entries[fqn] = coordinator.stored_value_entry(fqn, entry.path, plan.nodes[fqn], values, objects)
        record = None
        if self.settings.incremental:
            chunk_reports = [r.chunks for r in (own, *reports) if r.chunks is not None]
            record = incremental.chunk_record(specs, chunk_reports, self.earlier)
        coordinator.commit_save(self.settings, begun, entries, local.save_key_order(), specs, record)
