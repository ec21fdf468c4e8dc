"""A save planned by DCP: a planner that plans for itself (a subclass that rewrites items, DCP's caching planner seen
through, any ``SavePlanner``). Its global plan says which rank writes which box; the writer adds nodes and chunk
layouts (planning/assignments.py) and, where ranks hold the same entries, the replica checks (planning/replicas.py).

``local_plan``: the items, their dtypes checked. ``global_plans`` (the coordinator): the save begun, a
``RankAssignment`` for every rank. ``write``: the rank's items. ``finish`` (the coordinator): the manifest from DCP's
metadata and the write results, then the commit.
"""

from __future__ import annotations

import dataclasses

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.manifest import Entry
from dcp_zarr.format.torch_arrays import numpy_dtype
from dcp_zarr.planning import dcp_internals, replicas
from dcp_zarr.planning.assignments import RankAssignment, array_specs_for_plans, assignments, node_paths
from dcp_zarr.saving import coordinator, incremental
from dcp_zarr.saving.item_writes import write_items
from dcp_zarr.saving.settings import SaveSettings
from dcp_zarr.store_io.chunk_reuse import ChunkReuse, ReuseCounts


class DcpPlannedSave:
    def __init__(self, settings: SaveSettings, is_coordinator: bool):
        self.settings = settings
        self.is_coordinator = is_coordinator
        self.written_keys: list[str] = []
        self._local_items: dict = {}  # this rank's items before DCP's deduplication, by index (replicas.py)
        self._begun: coordinator.Begun | None = None  # the coordinator's, from global_plans
        self._specs: dict[str, ArraySpec] = {}
        self._nodes: dict[str, str] = {}
        self.earlier = incremental.open_earlier(settings)  # before anything is written
        self.reuse_counts: ReuseCounts | None = None  # this rank's, in a save that records its chunks

    def local_plan(self, plan: SavePlan) -> SavePlan:
        items = plan.items if plan.usable or plan.items else dcp_internals.cached_local_plan().items
        for item in items:
            if item.type != WriteItemType.BYTE_IO:
                assert item.tensor_data is not None  # DCP sets it on every item that is not BYTE_IO
                numpy_dtype(item.tensor_data.properties.dtype)  # raises naming the dtype if unsupported
        self._local_items = {item.index: item for item in items}
        if self.settings.check_replicas == replicas.NONE:
            return plan
        return dataclasses.replace(plan, storage_data=replicas.LocalItems(tuple(items)))

    def global_plans(self, plans: list[SavePlan]) -> list[SavePlan]:
        settings = self.settings
        local_plans = plans
        if dcp_internals.uses_plan_cache(plans):  # a caching planner's deltas: the plans are in its cache
            local_plans, plans = dcp_internals.cached_plans()
        checks = replicas.plan_checks(local_plans, settings.check_replicas, settings.replica_check_bytes)
        self._nodes = nodes = node_paths(plans)
        self._begun = begun = coordinator.begin(settings, len(plans))
        # One shard file per array, filled by several ranks, needs a backend that writes parts of a file (local
        # files do; an object is written whole, by one writer).
        self._specs = array_specs_for_plans(plans, nodes, settings.inner_chunk_bytes,
                                            array_shards=begun.storage.writes_at_offsets,
                                            compression=settings.compression,
                                            records_chunks=settings.incremental,
                                            whole_arrays=incremental.whole_arrays(self.earlier))
        # usable=True: a caching planner then takes these plans, this save's, not the ones it cached
        return [dataclasses.replace(plan, storage_data=assignment, usable=True)
                for plan, assignment in zip(plans, assignments(plans, self._specs, nodes, begun.staging_location,
                                                               checks))]

    def write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        assignment: RankAssignment = plan.storage_data
        results = replicas.checksums_result(self._local_items, assignment.replica_checks, planner)
        storage = self.settings.open(assignment.staging_location)
        reuse = ChunkReuse(self.earlier) if self.settings.incremental else None
        written, self.written_keys, _ = write_items(storage, plan.items, assignment, planner,
                                                    self.settings.thread_count, reuse=reuse)
        if reuse is not None:  # one more result, which finish takes out
            report = incremental.ChunkReport.of(reuse)
            self.reuse_counts = report.counts
            written.append(WriteResult(index=MetadataIndex(incremental.CHUNKS_FQN), size_in_bytes=0,
                                       storage_data=report))
        return results + written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        begun = self._begun
        assert begun is not None, "finish of a save without its prepare_global_plan"
        results, digests = replicas.split_results(results)
        chunk_reports = [r.storage_data for rank_results in results for r in rank_results
                         if r.index.fqn == incremental.CHUNKS_FQN]
        results = [[r for r in rank_results if r.index.fqn != incremental.CHUNKS_FQN] for rank_results in results]
        coordinator.refuse_differing_replicas(begun, digests)
        values: dict[str, object] = {}
        objects: dict[str, int] = {}
        sources: dict[str, dict] = {}  # how each tensor was held, as the first rank to write part of it says
        fills: dict[str, object] = {}  # the one element of each array kept in its fill_value (item_writes.py)
        for rank_results in results:
            for result in rank_results:
                fqn, stored = result.index.fqn, result.storage_data
                if "fill" in stored:
                    fills[fqn] = stored["fill"]
                if "source" in stored:
                    sources.setdefault(fqn, stored["source"])
                elif "value" in stored:
                    values.setdefault(fqn, stored["value"])
                elif "object_nbytes" in stored:
                    objects.setdefault(fqn, stored["object_nbytes"])
        entries: dict[str, Entry] = {}
        paths = metadata.planner_data or {}
        for fqn, md in metadata.state_dict_metadata.items():
            path = tuple(paths.get(fqn, (fqn,)))
            if isinstance(md, TensorStorageMetadata):
                entries[fqn] = coordinator.tensor_entry(
                    self._specs[fqn], path, tuple(md.size), bool(md.properties.requires_grad),
                    saved_shards=sum(1 for c in md.chunks if all(c.sizes)), source=sources.get(fqn),
                    fill=fills.get(fqn))
            else:
                entries[fqn] = coordinator.stored_value_entry(fqn, path, self._nodes[fqn], values, objects)
        record = incremental.chunk_record(self._specs, chunk_reports, self.earlier) if self.settings.incremental \
            else None
        coordinator.commit_save(self.settings, begun, entries, list(paths), self._specs, record)
