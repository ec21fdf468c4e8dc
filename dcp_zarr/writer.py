"""``ZarrWriter``: the ``torch.distributed.checkpoint`` StorageWriter that saves into a Zarr v3 store.

Planned locally (DCP's own planner, taken over in ``set_up_storage_writer``, or ``ZarrSavePlanner``): each rank's
plan is a digest of what it holds (planning/local_save.py), and the coordinator answers with a ticket. Planned by
DCP: prepare_global_plan turns DCP's global plan into node paths and chunk layouts (planning/dcp_plans.py). Either
way write_data writes each rank's chunks concurrently (store_io/chunks.py), and finish writes every zarr.json, the
manifest last, then commits (store_io/commit.py). docs/design.md has the whole data path.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import uuid
import warnings
from functools import partial

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from dcp_zarr.async_staging import WriterStaging
from dcp_zarr.collective.aggregated_writes import write_aggregated
from dcp_zarr.collective.transfer import Group
from dcp_zarr.collector import paused_on_main_thread, step_with_collector_paused
from dcp_zarr.errors import (
    InvalidEntryError,
    PlanMismatchError,
    ReplicaMismatchError,
    UnsupportedModeError,
    UntrustedTypeWarning,
)
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.chunk_layout import INNER_CHUNK_TARGET_BYTES, ChunkLayout, chunk_key, parent_groups
from dcp_zarr.format.consolidated import encoded_copy, encoded_root
from dcp_zarr.format.encoding import array_metadata, checksum, group_metadata
from dcp_zarr.format.group_attributes import group_attributes
from dcp_zarr.format.manifest import MANIFEST_ATTRIBUTE, ROOT_KEY, Entry, Manifest, ObjectEntry, TensorEntry, ValueEntry
from dcp_zarr.format.optimizer_tables import tables_from_entries
from dcp_zarr.format.sources import SourceDescriptions, summarize_sources
from dcp_zarr.format.torch_arrays import numpy_dtype, tensor_as_numpy, torch_dtype_name
from dcp_zarr.format.values import NotJSONError, encode_value
from dcp_zarr.json_documents import json_text
from dcp_zarr.placement.boxes import own_boxes_refused, says_its_own_boxes
from dcp_zarr.planning import plan_cache, replicas, save_call
from dcp_zarr.planning.dcp_plans import RankAssignment, array_specs_for_plans, assignments, node_paths
from dcp_zarr.planning.local_save import LocalSave
from dcp_zarr.planning.overrides import keeps_dcps
from dcp_zarr.planning.protocol import REPORT_FQN, RankReport, Summary, Ticket, check_summaries
from dcp_zarr.planning.save_planner import RankState
from dcp_zarr.storage import Storage, default_aggregate_below, is_local, open_storage, store_objects
from dcp_zarr.storage.retry import Retrying, RetryPolicy
from dcp_zarr.store_io import commit
from dcp_zarr.store_io.chunks import (
    chunk_regions,
    chunks_of_box,
    inner_chunk_runs,
    write_chunk,
    write_inner_chunks,
)
from dcp_zarr.store_io.entry_data import untrusted_types
from dcp_zarr.store_io.scheduler import run_jobs
from dcp_zarr.version import versions

# A rank's rows of an array-spanning shard are written in runs of about this many bytes: one job each, so a large
# box is spread over the IO threads (and a device tensor is copied to host a run at a time).
_SHARD_RUN_BYTES = 16 << 20
# What an aggregator holds at once, and a rank sends in one round (ZarrWriter's exchange_bytes).
DEFAULT_EXCHANGE_BYTES = 256 << 20
_NO_COLLECTIVES = (
    "ZarrWriter does not save with dcp.save(..., use_collectives=False): in that mode no rank hears of another, "
    "so no rank can know when every rank's chunks are in the store, and the store would be committed (look "
    "complete) with other ranks' chunks missing. Nothing was written. Save with use_collectives=True (the "
    "default): with DCP's own planner or ZarrSavePlanner, ZarrWriter plans each rank's part locally and DCP's "
    "collectives carry a fixed few bytes per rank, however many tensors a rank holds, which is what "
    "use_collectives=False is for at scale")


class ZarrWriter(StorageWriter, WriterStaging):
    """Save a DCP state dict as a Zarr v3 store: one array per tensor, at its global shape.

    With ``dcp.async_save`` the writer is also the stager (async_staging.py): the caller waits for a copy in host
    memory, pinned when the state dict has CUDA tensors.

    Args:
        path: a local directory or an fsspec URL (``s3://bucket/ckpt.zarr``, ``memory://x``); ``dcp.save``'s
            ``checkpoint_id`` replaces it.
        store: a zarr store object instead of ``path`` (``zarr.storage.ObjectStore``, ``FsspecStore``,
            ``MemoryStore``, ``LocalStore``): each rank passes its own. Committed as on an object store (the root
            ``zarr.json`` last, in place), except a ``LocalStore``, which is saved as its directory path would be.
        storage_options: passed to fsspec for URLs (credentials, ``endpoint_url``, ...).
        thread_count: concurrent chunk writes per rank.
        sync_files: fsync chunks and directories before the commit (local paths).
        overwrite: whether a checkpoint already at ``path`` is replaced. ``None`` (the default): where the old
            checkpoint survives until the new one is complete, as on a local or shared file system (the new store is
            swapped in by one rename), so that a job resuming from an earlier step can save that step again, as with
            DCP's ``FileSystemWriter``; on object stores, which have no rename and where replacing means deleting the
            old checkpoint first, it is refused. ``True``: replaced everywhere (on object stores, deleted first).
            ``False``: never replaced.
        inner_chunk_bytes: target size of the inner chunks of large arrays (partial reads on resharded loads).
        cache_staged_state_dict: keep ``dcp.async_save``'s staging buffers for the next save with this writer
            (``checkpoint_id=`` per save, each after the previous one's future resolved); ``close()`` frees them.
        check_replicas: entries several ranks save under one key (DCP keeps one rank's copy) must agree, or the
            save is refused (``ReplicaMismatchError``) and nothing is committed: ``"small"`` compares kind, shape and
            dtype of all of them and the values of non-tensor entries and of tensors up to ``replica_check_bytes``;
            ``"all"`` compares every value; ``"none"`` checks nothing (replicas.py).
        retry: the ``RetryPolicy`` of this writer's object-store calls (default: ``storage.retry.DEFAULT_POLICY``).
        aggregate_below: planned locally (DCP's own planner, or ``ZarrSavePlanner``), an array held in pieces by
            several ranks, none of them this many bytes or more, is written by an aggregator rank as one object per
            block instead of one per rank: its pieces travel over the save's process group (collective/). Default:
            the storage's own (``Storage.aggregate_below``: larger for object stores, where every object is a
            request); 0: never.
        exchange_bytes: the bytes of blocks an aggregator holds at once, and of parts a rank sends in one round,
            when pieces are aggregated; also the largest block written as one object.
    """

    def __init__(self, path: str | os.PathLike = "", *, store=None, storage_options: dict | None = None,
                 thread_count: int = 4, sync_files: bool = True, overwrite: bool | None = None,
                 inner_chunk_bytes: int = INNER_CHUNK_TARGET_BYTES,
                 cache_staged_state_dict: bool = False, check_replicas: str = replicas.SMALL,
                 replica_check_bytes: int = replicas.DEFAULT_MAX_BYTES, retry: RetryPolicy | None = None,
                 aggregate_below: int | None = None, exchange_bytes: int = DEFAULT_EXCHANGE_BYTES):
        if check_replicas not in replicas.CHECK_MODES:
            raise ValueError(f"check_replicas={check_replicas!r}: expected one of {', '.join(replicas.CHECK_MODES)}")
        self.path, self.store = store_objects.resolve("ZarrWriter", path, store, writable=True)
        self.storage_options = storage_options
        self.thread_count = max(1, int(thread_count))
        self.sync_files = sync_files
        if overwrite not in (None, True, False):
            raise ValueError(f"overwrite={overwrite!r}: expected True, False or None (replace only where the old "
                             "checkpoint survives until the new one is complete)")
        self.overwrite = overwrite
        self.inner_chunk_bytes = inner_chunk_bytes
        self.check_replicas = check_replicas
        self.replica_check_bytes = int(replica_check_bytes)
        self.retry = retry
        if aggregate_below is not None and (type(aggregate_below) is not int or aggregate_below < 0):
            raise ValueError(f"aggregate_below={aggregate_below!r}: expected a number of bytes >= 0, or None for the "
                             "storage's default")
        if type(exchange_bytes) is not int or exchange_bytes < 1:
            raise ValueError(f"exchange_bytes={exchange_bytes!r}: expected a number of bytes >= 1")
        self.aggregate_below = aggregate_below
        self.exchange_bytes = exchange_bytes
        # One for every storage this writer opens: whether the store has answered yet decides whether a refused
        # connection is retried (retry.py).
        self._retrying = Retrying(retry)
        WriterStaging.__init__(self, cache_staged_state_dict)
        self.save_id: str | None = None
        self.is_coordinator = False
        self._specs: dict[str, ArraySpec] = {}
        self._nodes: dict[str, str] = {}
        self._staging = ""
        self._world_size = 1
        self._local_items: dict = {}  # this rank's items before DCP's deduplication, by index (replicas.py)
        self._local: LocalSave | None = None  # this rank's part of a save planned locally (planning/local_save.py)
        self._rank: int | None = None
        self._detail_groups: frozenset[str] = frozenset()  # replica groups whose digests differed (protocol.py)
        self._own_values: dict = {}  # the coordinator's written values and object sizes (not sent to itself)
        self._own_objects: dict = {}
        self.written_keys: list[str] = []  # this rank's chunk keys in the last save: lets tests prove ownership

    # -- StorageWriter interface -------------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.save_started()  # with checkpoint_id=, DCP's first call in a save, in the thread that runs it
        if checkpoint_id:
            if self.store is not None:
                raise ValueError(f"ZarrWriter(store=...) saves into its store; checkpoint_id={checkpoint_id!r} cannot "
                                 "name another place: make a writer per store, or pass paths instead")
            self.path = os.fspath(checkpoint_id)
        self.save_id = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        self.save_started()  # the first call in a save without checkpoint_id=
        return StorageMeta(checkpoint_id=self._target(), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        if not self.path and self.store is None:
            raise ValueError("ZarrWriter needs a path or a store: pass path or store=, or checkpoint_id= to dcp.save")
        if kwargs.get("use_collectives", True) is False:
            # Every rank gets here before anything is written (DCP calls this first on each rank, and in this mode
            # no rank waits for another), so every rank refuses alike.
            raise UnsupportedModeError(_NO_COLLECTIVES)
        self.is_coordinator = is_coordinator
        self._rank = kwargs.get("rank")  # in DCP's process group (torch passes it to a method taking **kwargs)
        if is_coordinator and self.store is not None:
            commit.check_stored(self._open(""), self._replaces())
        elif is_coordinator:
            commit.check_target(self.path, self.storage_options, self._replaces(), retry=self._retrying)
        # DCP's own planner (planner=None, or a DefaultSavePlanner that plans as DCP does) plans this save locally,
        # as ZarrSavePlanner would: dcp.save(sd, storage_writer=ZarrWriter(p)) is the line users write. DCP asks
        # it for its plan next.
        call = save_call.dcp_save_call()
        if call is not None:
            save_call.take_over(call)

    @step_with_collector_paused
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._own_values, self._own_objects = {}, {}
        if isinstance(plan.planner_data, RankState):  # planned here, as ZarrSavePlanner plans: a digest goes to DCP
            self._local = LocalSave(plan.planner_data, self._rank, self.is_coordinator, self.check_replicas,
                                    self.replica_check_bytes, self._aggregate_below(), self.exchange_bytes,
                                    self.inner_chunk_bytes)
            # planner_data={}: what DCP's own planner, taken over, merges into its (empty) metadata
            return SavePlan(items=[], storage_data=self._local.summary, planner_data={})
        self._local = None
        items = plan.items if plan.usable or plan.items else plan_cache.cached_local_plan().items
        for item in items:
            if item.type != WriteItemType.BYTE_IO:
                assert item.tensor_data is not None  # DCP sets it on every item that is not BYTE_IO
                numpy_dtype(item.tensor_data.properties.dtype)  # raises naming the dtype if unsupported
        self._local_items = {item.index: item for item in items}
        if self.check_replicas == replicas.NONE:
            return plan
        return dataclasses.replace(plan, storage_data=replicas.LocalItems(tuple(items)))

    @step_with_collector_paused
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # before anything is written
        planned_here = [isinstance(plan.storage_data, Summary) for plan in plans]
        if any(planned_here) and not all(planned_here):
            raise PlanMismatchError(
                f"{replicas.ranks_text([r for r, here in enumerate(planned_here) if here])} planned this save "
                f"locally (DCP's own planner or ZarrSavePlanner) and "
                f"{replicas.ranks_text([r for r, here in enumerate(planned_here) if not here])} through a planner "
                "that plans for itself: every rank must pass dcp.save a planner of the same kind. Nothing was written")
        if plans and isinstance(plans[0].storage_data, Summary):
            summaries = [plan.storage_data for plan in plans]
            if len(plans) == 1 and self._local is not None:
                self._local.plan_alone()
                summaries = [self._local.summary]
            exchange, detail_groups = check_summaries(summaries)
            self._detail_groups = detail_groups
            self._begin_save(len(plans))
            ticket = Ticket(self.save_id or "", self._staging, exchange, detail_groups)
            return [dataclasses.replace(plan, storage_data=ticket) for plan in plans]
        local_plans = plans
        if plan_cache.uses_cache(plans):  # a caching planner's deltas: the plans are in its cache
            local_plans, plans = plan_cache.cached_plans()
        checks = replicas.plan_checks(local_plans, self.check_replicas, self.replica_check_bytes)
        self._nodes = nodes = node_paths(plans)
        staging = self._begin_save(len(plans))
        # One shard file per array, filled by several ranks, needs a backend that writes parts of a file (local
        # files do; an object is written whole, by one writer).
        self._specs = array_specs_for_plans(plans, nodes, self.inner_chunk_bytes,
                                            array_shards=staging.writes_at_offsets)
        # usable=True: a caching planner then takes these plans, this save's, not the ones it cached
        return [dataclasses.replace(plan, storage_data=assignment, usable=True)
                for plan, assignment in zip(plans, assignments(plans, self._specs, nodes, self._staging, checks))]

    def _begin_save(self, world_size: int) -> Storage:
        """The coordinator's choices before anything is written: the save's id and its staging area, prepared."""
        self._world_size = world_size
        self.save_id = uuid.uuid4().hex[:12]
        # A store object is written in place, by each rank through its own store: the location is only a name.
        self._staging = self._target() if self.store is not None else commit.staging_location(self.path, self.save_id)
        staging = self._open(self._staging)
        commit.prepare_staging(staging)
        return staging

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        with paused_on_main_thread(self.store is None and is_local(self.path)):  # collector.py says why
            if isinstance(plan.storage_data, Ticket):
                try:
                    results = self._write_planned_locally(plan.storage_data, planner)
                except BaseException:
                    self._local = None
                    raise
                if not self.is_coordinator:  # the coordinator's finish still needs it
                    self._local = None  # it holds the planner, and so the state dict: not kept past the save
                future.set_result(results)
                return future
            assignment: RankAssignment = plan.storage_data
            results = replicas.checksums_result(self._local_items, assignment.replica_checks, planner)
            results.extend(self._write_items(plan.items, assignment, planner))
        future.set_result(results)
        return future

    def _write_planned_locally(self, ticket: Ticket, planner: SavePlanner) -> list[WriteResult]:
        """This rank's part of a save planned locally, and the one WriteResult that reports it (protocol.py)."""
        local = self._local
        assert local is not None, "write_data of a save planned locally without its prepare_local_plan"
        checksums = local.reported_checksums(ticket)
        values, objects = {}, {}
        nbytes = 0
        if not ticket.detail_groups:  # replicas that disagree: their checksums, for finish's error; nothing written
            storage = self._open(ticket.staging_location)
            items, assignment = local.rank_writes(ticket, self.inner_chunk_bytes, storage.writes_at_offsets)
            aggregated_keys = self._write_aggregated(local, storage, planner)
            for result in self._write_items(items, assignment, planner, with_sources=False):
                nbytes += result.size_in_bytes
                if "value" in result.storage_data:
                    values[result.index.fqn] = result.storage_data["value"]
                elif "object_nbytes" in result.storage_data:
                    objects[result.index.fqn] = result.storage_data["object_nbytes"]
            self.written_keys = aggregated_keys + self.written_keys
        if self.is_coordinator:  # kept here for finish: DCP pads every rank's gathered results to the largest
            self._own_values, self._own_objects = values, objects
            values, objects = {}, {}
        report = RankReport(values, objects, checksums)
        return [WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=nbytes, storage_data=report)]

    def _write_aggregated(self, local: LocalSave, storage: Storage, planner: SavePlanner) -> list[str]:
        """The blocks of the arrays aggregated in this save (collective/): every rank of the save takes part in
        every round, on the planner's process group, which is the one DCP saves on (check_summaries): for
        dcp.async_save, the background save's own group, whose collectives nothing else interleaves with."""
        aggregation = local.aggregation(self.inner_chunk_bytes)
        if not aggregation.arrays:
            return []
        entries = local.global_entries()
        specs = local.array_specs(self.inner_chunk_bytes, storage.writes_at_offsets, set(aggregation.arrays))

        def held() -> dict:  # called inside the exchange, so that a tensor that cannot be saved fails every rank
            return {fqn: [(box, _checked_tensor(tensor, fqn)) for box, tensor in boxes]
                    for fqn, boxes in local.held_pieces(planner, self.inner_chunk_bytes).items()}

        return write_aggregated(aggregation, entries, specs, held, Group(local.group), storage, self.thread_count,
                                local.merged)

    def _write_items(self, items: list[WriteItem], assignment: RankAssignment, planner: SavePlanner,
                     with_sources: bool = True) -> list[WriteResult]:
        """Write this rank's items and the zarr.json of the arrays it describes; one WriteResult per item."""
        storage = self._open(assignment.staging_location)
        results: list[WriteResult] = []
        jobs: list[tuple[int, partial]] = [(0, partial(_write_array_metadata, storage, assignment.arrays[fqn]))
                                           for fqn in sorted(assignment.describes)]
        chunk_keys: list[str] = []
        devices: set[torch.device] = set()  # of tensors copied to host on the IO threads
        describe_source = SourceDescriptions()
        resolve = _tensor_resolver(planner)
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                result, write = _value_write(item, planner, assignment.nodes[item.index.fqn])
                if write:
                    chunk_keys.append(write[0])
                    jobs.append((len(write[1][0]), partial(storage.write, *write)))
                    node = assignment.nodes[item.index.fqn]
                    jobs.append(_metadata_job(storage, node, _object_array_metadata(
                        item.index.fqn, node, result.storage_data["object_nbytes"])))
            else:
                spec = assignment.arrays[item.index.fqn]
                tensor_data = item.tensor_data
                assert tensor_data is not None  # DCP sets it on every item that is not BYTE_IO
                tensor = _checked_tensor(resolve(item), item.index.fqn)
                offsets = tensor_data.chunk.offsets
                nbytes = tensor.numel() * tensor.element_size()
                if spec.layout.spans_array and storage.writes_at_offsets:
                    written, shard_jobs = _array_shard_jobs(storage, spec, tensor, offsets[0])
                    chunk_keys.extend(written)
                    jobs.extend(shard_jobs)
                    if not _on_host(tensor):
                        devices.add(tensor.device)
                elif _on_host(tensor):
                    for chunk, data in chunks_of_box(spec.layout, offsets, tensor_as_numpy(tensor)):
                        key = f"{spec.node}/{chunk}"
                        chunk_keys.append(key)
                        jobs.append((data.nbytes, partial(write_chunk, storage, key, data, spec.layout)))
                else:
                    # Each chunk of a device tensor is copied to host memory on an IO thread just before it is
                    # written: copies overlap other chunks' writes, and at most thread_count chunks are in host
                    # memory at once (copying every tensor first would hold a host copy of the whole state dict).
                    devices.add(tensor.device)
                    for chunk, region in chunk_regions(spec.layout, offsets, tensor.shape):
                        key = f"{spec.node}/{chunk}"
                        chunk_keys.append(key)
                        jobs.append((_region_bytes(tensor, region),
                                     partial(_write_from_device, storage, key, tensor, region, spec.layout)))
                storage_data = {}
                if with_sources:
                    storage_data["source"] = describe_source(getattr(planner, "state_dict", {}).get(item.index.fqn))
                result = WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=storage_data)
            results.append(result)
        self.written_keys = chunk_keys
        _wait_for_current_streams(devices)
        run_jobs(jobs, storage.requests_in_flight(self.thread_count), storage.batch_bytes, name="dcp-zarr-write",
                 max_bytes_in_flight=storage.max_bytes_in_flight)
        storage.flush()  # this rank's chunks are durable before the coordinator can commit
        return results

    @step_with_collector_paused
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = self._open(self._staging)
        if self._local is not None:
            try:
                self._finish_planned_locally(storage, results)
            finally:
                self._local = None  # it holds the planner, and so the state dict: not kept past the save
            return
        results, digests = replicas.split_results(results)
        try:
            replicas.compare_checksums(digests)
        except ReplicaMismatchError:
            commit.abandon(storage)
            raise
        by_fqn: dict[str, list] = {}
        for rank_results in results:
            for result in rank_results:
                by_fqn.setdefault(result.index.fqn, []).append(result.storage_data)
        entries: dict[str, Entry] = {}  # array zarr.json files were written by the ranks (RankAssignment.describes)
        paths = metadata.planner_data or {}
        for fqn, md in metadata.state_dict_metadata.items():
            path = tuple(paths.get(fqn, (fqn,)))
            if isinstance(md, TensorStorageMetadata):
                entries[fqn] = _tensor_entry(fqn, path, self._specs[fqn], md, by_fqn.get(fqn, []))
            elif "value" in by_fqn[fqn][0]:
                entries[fqn] = ValueEntry(fqn, path, self._nodes[fqn], by_fqn[fqn][0]["value"])
            else:
                entries[fqn] = ObjectEntry(fqn, path, self._nodes[fqn], by_fqn[fqn][0]["object_nbytes"])
        self._commit(storage, entries, key_order=list(paths))

    def _finish_planned_locally(self, storage: Storage, results: list[list[WriteResult]]) -> None:
        """The manifest of a save planned locally, from the coordinator's own plan and each rank's one report."""
        local = self._local
        assert local is not None
        reports: list[RankReport] = [r.storage_data for rank_results in results for r in rank_results
                                     if r.index.fqn == REPORT_FQN]
        try:
            replicas.compare_checksums([report.checksums for report in reports])
        except ReplicaMismatchError:
            commit.abandon(storage)
            raise
        if self._detail_groups:  # nothing was written; compare_checksums names the keys, this is the backstop
            commit.abandon(storage)
            raise ReplicaMismatchError(f"replicated entries differ between the ranks of {sorted(self._detail_groups)}"
                                       "; nothing was committed")
        values = dict(self._own_values)
        values.update((fqn, v) for report in reports for fqn, v in report.values.items())
        objects = dict(self._own_objects)
        objects.update((fqn, n) for report in reports for fqn, n in report.objects.items())
        array_shards = storage.writes_at_offsets
        specs, saved_shards = local.saved_arrays(self.inner_chunk_bytes, array_shards)
        self._specs = specs
        self._nodes = nodes = local.global_nodes()
        entries: dict[str, Entry] = {}
        for fqn, entry in local.global_entries().items():
            if fqn in specs:
                entries[fqn] = TensorEntry(
                    fqn=fqn, path=entry.path, node=nodes[fqn], dtype=specs[fqn].dtype_name, shape=entry.size,
                    chunk_shape=specs[fqn].layout.chunk_shape, inner_chunk_rows=specs[fqn].layout.inner_rows,
                    requires_grad=entry.requires_grad, saved_shards=saved_shards[fqn],
                    source=entry.source or {"type": "unknown"})
            elif fqn in values:
                entries[fqn] = ValueEntry(fqn, entry.path, nodes[fqn], values[fqn])
            else:
                entries[fqn] = ObjectEntry(fqn, entry.path, nodes[fqn], objects[fqn])
        self._commit(storage, entries, key_order=local.global_key_order())

    def _commit(self, storage: Storage, entries: dict[str, Entry], key_order: list) -> None:
        """Every group's zarr.json, then the root's (the manifest, every node's zarr.json copied), then the commit.
        A group's values are its attributes too, for zarr tools (format/group_attributes.py)."""
        attributes = group_attributes(entries, key_order)
        groups = {group: group_metadata(attributes.get(group))
                  for group in {g for entry in entries.values() for g in parent_groups(entry.node)}}
        run_jobs([(0, partial(storage.write_json, f"{group}/zarr.json", doc)) for group, doc in groups.items()],
                 storage.requests_in_flight(self.thread_count), storage.batch_bytes)
        manifest = self._manifest(entries, key_order=key_order)
        copies = {group: encoded_copy(document) for group, document in groups.items()}
        copies.update(self._array_copies(entries))
        root = group_metadata({MANIFEST_ATTRIBUTE: manifest.to_json(), **attributes.get("", {})})
        storage.write(ROOT_KEY, [encoded_root(root, copies)])
        commit.commit(storage, self.path, replace=self._replaces())

    # -- helpers -----------------------------------------------------------------------------------------------------

    def _open(self, location: str) -> Storage:
        if self.store is not None:
            return store_objects.open_store(self.store, self._retrying)
        return open_storage(location, self.storage_options, sync_files=self.sync_files, retry=self._retrying)

    def _replaces(self) -> bool:
        """Whether this save replaces a checkpoint at its target: ``overwrite``, or by default where the old one is
        kept until the new one is complete (a local path, or a ``LocalStore``, which resolve() made a path)."""
        if self.overwrite is not None:
            return self.overwrite
        return self.store is None and is_local(self.path)

    def _aggregate_below(self) -> int:
        """The piece size under which arrays are aggregated: the writer's, else its storage's default."""
        if self.aggregate_below is not None:
            return self.aggregate_below
        return default_aggregate_below(self.path, self.store, self._retrying)

    def _target(self) -> str:
        return store_objects.label(self.store) if self.store is not None else self.path

    def _array_copies(self, entries: dict[str, Entry]) -> dict[str, str]:
        """Node -> encoded zarr.json of every array, as the ranks wrote them (RankAssignment.describes), for the
        root's consolidated metadata."""
        copies = {}
        for fqn, entry in entries.items():
            if isinstance(entry, TensorEntry):
                copies[entry.node] = _encoded_array_metadata(self._specs[fqn])  # an array's copy is its zarr.json
            elif isinstance(entry, ObjectEntry):
                copies[entry.node] = encoded_copy(_object_array_metadata(fqn, entry.node, entry.nbytes))
        return copies

    def _manifest(self, entries: dict[str, Entry], key_order: tuple | list = ()) -> Manifest:
        # key_order: the saved state dict's own key order (DCP's planner_data), which numbers the params of a
        # flattened optimizer state dict; entries come in plan order, which deduplication reshuffles.
        summary = summarize_sources([e.source for e in entries.values() if isinstance(e, TensorEntry)])
        # Anything in a table that JSON cannot hold fails at save: encoded_root dumps the whole manifest before the
        # commit.
        tables = tables_from_entries(entries, key_order)
        return Manifest(entries=entries, save_id=self.save_id, versions=versions(), saved_world_size=self._world_size,
                        state_dict_type=summary["state_dict_type"], meshes=summary["meshes"], optimizers=tuple(tables))


def _checked_tensor(value, fqn: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidEntryError(
            f"state-dict entry {fqn!r}: expected a tensor, the planner returned {type(value).__name__}")
    tensor = value.detach()
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise InvalidEntryError(
            f"state-dict entry {fqn!r}: {tensor.layout} tensors are not supported; save a dense tensor")
    return tensor


def _tensor_resolver(planner: SavePlanner):
    """``planner.resolve_data`` for tensor items; for DCP's own resolution (DefaultSavePlanner's, ZarrSavePlanner's)
    the state dict's tensor, or a DTensor's local one, looked up directly: DCP's lookup goes through its protocol
    checks and, for a DTensor, an autograd Function per tensor, which a save of 800 tensors felt."""
    own = keeps_dcps(planner, DefaultSavePlanner, ("resolve_data", "lookup_object", "transform_object"))
    state_dict = getattr(planner, "state_dict", None) if own else None
    if not isinstance(state_dict, dict):
        return planner.resolve_data

    def resolve(item: WriteItem):
        value = state_dict.get(item.index.fqn)
        if type(value) is DTensor:
            return value._local_tensor
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
            if says_its_own_boxes(value):  # a save DCP planned: its items are boxes this writer does not lay out
                raise InvalidEntryError(own_boxes_refused(item.index.fqn))
            return value
        return planner.resolve_data(item)  # anything else (ShardedTensor shards, subclasses) DCP's way

    return resolve


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _array_shard_jobs(storage, spec: ArraySpec, tensor: torch.Tensor, first_row: int
                      ) -> tuple[list[str], list[tuple[int, partial]]]:
    """This rank's writes into an array-spanning shard: runs of its inner chunks at their offsets, the index with
    the shard's last inner chunk (it follows that chunk in the file). Also what it writes, ``"node/c.0.0#3"`` per
    inner chunk, so tests can prove that no inner chunk is written by two ranks."""
    layout = spec.layout
    key = f"{spec.node}/{layout.chunk_key((0,) * len(layout.shape))}"
    host = tensor_as_numpy(tensor) if _on_host(tensor) else None
    row_bytes = math.prod(layout.shape[1:]) * spec.itemsize
    written: list[str] = []
    jobs: list[tuple[int, partial]] = []
    held_rows = tensor.shape[0] if tensor.numel() else 0  # an empty shard ((11, 5, 0) of an (11, 5, 1)) holds none
    for first, rows in inner_chunk_runs(layout, first_row, held_rows, spec.itemsize, _SHARD_RUN_BYTES):
        count = -(-(rows.stop - rows.start) // layout.inner_rows)
        written.extend(f"{key}#{i}" for i in range(first, first + count))
        with_index = first + count == layout.inner_chunks_per_chunk
        if with_index:
            written.append(f"{key}#index")
        job = (partial(write_inner_chunks, storage, key, host[rows], first, layout, with_index) if host is not None
               else partial(_write_rows_from_device, storage, key, tensor, rows, first, layout, with_index))
        jobs.append(((rows.stop - rows.start) * row_bytes, job))
    return written, jobs


def _write_rows_from_device(storage, key: str, tensor: torch.Tensor, rows: slice, first: int,
                            layout: ChunkLayout, with_index: bool) -> None:
    write_inner_chunks(storage, key, tensor_as_numpy(tensor[rows].to("cpu")), first, layout, with_index)


def _region_bytes(tensor: torch.Tensor, region: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in region) * tensor.element_size()


def _write_from_device(storage, key: str, tensor: torch.Tensor, region: tuple[slice, ...], layout: ChunkLayout) -> None:
    write_chunk(storage, key, tensor_as_numpy(tensor[region].to("cpu")), layout)


def _wait_for_current_streams(devices: set[torch.device]) -> None:
    """The IO threads copy on their own streams, which do not wait for the caller's: wait here for the work queued on
    the caller's current stream (what produced the tensors) before any copy starts."""
    for device in devices:
        if device.type != "cpu":
            torch.get_device_module(device.type).current_stream(device).synchronize()


def _array_metadata(spec: ArraySpec) -> dict:
    return array_metadata(spec.layout, spec.data_type, spec.itemsize,
                          {"dcp_zarr": {"fqn": spec.fqn, "dtype": spec.dtype_name}}, node=spec.node)


def _object_array_metadata(fqn: str, node: str, nbytes: int) -> dict:
    return array_metadata(ChunkLayout((nbytes,), (max(nbytes, 1),)), "uint8", 1,
                          {"dcp_zarr": {"fqn": fqn, "content": "torch.save bytes (load with weights_only=True)"}},
                          node=node)


def _metadata_job(storage, node: str, document: dict) -> tuple[int, partial]:
    return 0, partial(storage.write_json, f"{node}/zarr.json", document)


def _write_array_metadata(storage, spec: ArraySpec) -> None:
    # The document is made on the IO thread, just before it is written, not with the job: hundreds of them alive at
    # once (twenty dicts and lists each) would set off the garbage collector's full collections (consolidated.py).
    storage.write(f"{spec.node}/zarr.json", [_encoded_array_metadata(spec).encode()])


@functools.lru_cache(maxsize=1 << 14)
def _encoded_array_metadata(spec: ArraySpec) -> str:
    """The array's zarr.json, encoded, as written to its node and copied into the root's consolidated metadata: a
    function of the spec alone, made once a process for each array of a model saved again and again (making the 800
    copies took 9 of the 18 ms of the coordinator's ``finish``, which every rank's save waits for)."""
    return json_text(_array_metadata(spec))


def _value_write(item, planner: SavePlanner, node: str):
    """The WriteResult of a non-tensor entry, and the (key, buffers) to write when it is not JSON."""
    lookup = getattr(planner, "lookup_object", None)
    value = None
    if lookup is not None:
        value = lookup(item.index)
        try:
            document = encode_value(value)
            size = len(json.dumps(document))
            return WriteResult(index=item.index, size_in_bytes=size, storage_data={"value": document}), None
        except NotJSONError:
            pass
    resolved = planner.resolve_data(item)
    assert isinstance(resolved, io.BytesIO)  # DCP's planners torch.save a BYTE_IO item into one
    data = resolved.getvalue()
    untrusted = untrusted_types(data)
    if untrusted:  # it saves, but would fail at load without options: say so now, while the run can change it
        kind = "" if value is None else f" ({type(value).__module__}.{type(value).__qualname__})"
        warnings.warn(UntrustedTypeWarning(
            f"state-dict value {item.index.fqn!r}{kind} is stored as torch.save bytes holding types that "
            f"torch.load(weights_only=True) does not trust: {', '.join(untrusted)}. Loading it will need "
            "ZarrReader(..., safe_globals=[...]) or open_checkpoint(..., safe_globals=[...]) naming them"),
            stacklevel=2)
    result = WriteResult(index=item.index, size_in_bytes=len(data), storage_data={"object_nbytes": len(data)})
    return result, (f"{node}/{chunk_key((0,))}", [data, checksum(data)])


def _tensor_entry(fqn: str, path: tuple, spec: ArraySpec, md: TensorStorageMetadata, stored: list) -> TensorEntry:
    """The manifest entry of a tensor: its grid, not the saved boxes (every box is whole chunks of that grid)."""
    sources = [s["source"] for s in stored if "source" in s]
    return TensorEntry(
        fqn=fqn, path=path, node=spec.node, dtype=torch_dtype_name(md.properties.dtype), shape=tuple(md.size),
        chunk_shape=spec.layout.chunk_shape, inner_chunk_rows=spec.layout.inner_rows,
        requires_grad=bool(md.properties.requires_grad),
        saved_shards=sum(1 for c in md.chunks if all(c.sizes)),
        source=sources[0] if sources else {"type": "unknown"},
    )
