"""``ZarrWriter``: the ``torch.distributed.checkpoint`` StorageWriter that saves into a Zarr v3 store.

A thin front: each save is one object (saving/), chosen at the save's first callback that carries a plan and dropped
with the save. Planned locally (DCP's own planner, taken over in ``set_up_storage_writer``, or ``ZarrSavePlanner``):
``LocallyPlannedSave``. Planned by DCP: ``DcpPlannedSave``. docs/design.md has the whole data path.
Implementation: ``ZarrWriter`` is public as ``dcp_zarr.ZarrWriter``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_zarr.collective.transfer import DEFAULT_EXCHANGE_BYTES
from dcp_zarr.errors import UnsupportedModeError
from dcp_zarr.format.chunk_layout import INNER_CHUNK_TARGET_BYTES
from dcp_zarr.format.compression import Compression
from dcp_zarr.gc_pause import paused_on_main_thread, step_with_collector_paused
from dcp_zarr.planning import dcp_internals, replicas, same_checkpoint
from dcp_zarr.planning.protocol import planned_locally
from dcp_zarr.planning.save_planner import RankState, rank_plan
from dcp_zarr.saving.dcp_planned_save import DcpPlannedSave
from dcp_zarr.saving.locally_planned_save import LocallyPlannedSave
from dcp_zarr.saving.save import Save
from dcp_zarr.saving.settings import SaveSettings
from dcp_zarr.staging.async_stager import WriterStaging
from dcp_zarr.storage import store_objects
from dcp_zarr.storage.retry import Retrying, RetryPolicy
from dcp_zarr.store_io import commit
from dcp_zarr.store_io.chunk_reuse import ReuseCounts

_NO_COLLECTIVES = (
    "ZarrWriter does not save with dcp.save(..., use_collectives=False): in that mode no rank hears of another, "
    "so no rank can know when every rank's chunks are in the store, and the store would be committed (look "
    "complete) with other ranks' chunks missing. Nothing was written. Save with use_collectives=True (the "
    "default): with DCP's own planner or ZarrSavePlanner, ZarrWriter plans each rank's part locally and DCP's "
    "collectives carry a fixed few bytes per rank, however many tensors a rank holds, which is what "
    "use_collectives=False is for at scale")


class _Start(NamedTuple):
    is_coordinator: bool
    rank: int | None  # in DCP's process group


class ZarrWriter(StorageWriter, WriterStaging):
    """Save a DCP state dict as a Zarr v3 store: one array per tensor, at its global shape.

    With ``dcp.async_save`` the writer is also the stager (staging/): the caller waits for a copy in host
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
            old checkpoint first, it is refused. ``True``: replaced everywhere (on object stores, deleted first),
            and so is an interrupted save's store, which nothing else replaces. ``False``: never replaced.
        inner_chunk_bytes: target size of the inner chunks of large arrays (partial reads on resharded loads).
        cache_staged_state_dict: ``None`` (the default) or ``True``: ``dcp.async_save`` copies into host buffers
            the process keeps for the next save of the same state dict, whichever writer makes it (pinned for CUDA
            tensors; bounded: ``dcp_zarr.set_staging_memory_limit``); ``close()`` releases this writer's,
            ``dcp_zarr.release_staging_memory()`` all. ``False``: each save stages into memory freed with it.
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
        compression: lossless compression of floating-point arrays, as zarr v3's standard ``blosc`` codec (zarr
            tools read them without dcp_zarr): None (the default) stores every array as it is; True or ``"lz4"``
            (bit shuffle then lz4), ``"zstd"`` or another blosc compressor compress at level 1; a
            ``dcp_zarr.Compression`` sets the level, the smallest array compressed and the ratio a sample must reach
            (docs/compression.md).
        incremental: lay the checkpoint out for incremental saves (one object per chunk of about
            ``inner_chunk_bytes``, each chunk's digest recorded in the manifest; an array that changed whole, or not
            at all, in the earlier checkpoint, a full save's shards of up to 16 chunks), so that a later save can
            reuse its chunks. Implied by ``incremental_from``. Default: a full save, laid out as before.
        incremental_from: the path of an earlier checkpoint on the same storage: this save stores only the chunks
            whose bytes differ from it; the others are hard links to its files (local file systems) or server-side
            copies (object stores), so the new checkpoint is complete on its own, and deleting the earlier one never
            touches it (docs/incremental.md). Checked before anything is written (``IncrementalBaseError``).
    """

    def __init__(self, path: str | os.PathLike = "", *, store=None, storage_options: dict | None = None,
                 thread_count: int = 4, sync_files: bool = True, overwrite: bool | None = None,
                 inner_chunk_bytes: int = INNER_CHUNK_TARGET_BYTES,
                 cache_staged_state_dict: bool | None = None, check_replicas: str = replicas.SMALL,
                 replica_check_bytes: int = replicas.DEFAULT_MAX_BYTES, retry: RetryPolicy | None = None,
                 aggregate_below: int | None = None, exchange_bytes: int = DEFAULT_EXCHANGE_BYTES,
                 compression: str | bool | Compression | None = None, incremental: bool | None = None,
                 incremental_from: str | os.PathLike | None = None):
        path, store = store_objects.resolve("ZarrWriter", path, store, writable=True)
        # Made once, checked as it is made; every save of this writer runs with it (reset's checkpoint_id= gives a
        # copy with that path). Its Retrying is one for every storage this writer opens: whether the store has
        # answered yet decides whether a refused connection is retried (retry.py).
        self.settings = SaveSettings(
            path=path, store=store, storage_options=storage_options, thread_count=thread_count, sync_files=sync_files,
            overwrite=overwrite, inner_chunk_bytes=inner_chunk_bytes, check_replicas=check_replicas,
            replica_check_bytes=replica_check_bytes, aggregate_below=aggregate_below, exchange_bytes=exchange_bytes,
            retrying=Retrying(retry), compression=Compression.of(compression),
            incremental=incremental_from is not None if incremental is None else incremental,
            incremental_from=None if incremental_from is None else os.fspath(incremental_from))
        WriterStaging.__init__(self, cache_staged_state_dict)
        self._starting: _Start | None = None  # from set_up_storage_writer to the save's first plan
        self._save: Save | None = None  # the save under way (saving/): made at its first plan, dropped with it
        self.written_keys: list[str] = []  # this rank's chunk keys in the last save: lets tests prove ownership
        # this rank's chunks linked and written in the last save, where it recorded its chunks (incremental)
        self.reuse_counts: ReuseCounts | None = None

    # -- StorageWriter interface -------------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.save_started()  # with checkpoint_id=, DCP's first call in a save, in the thread that runs it
        if checkpoint_id:
            if self.store is not None:
                raise ValueError(f"ZarrWriter(store=...) saves into its store; checkpoint_id={checkpoint_id!r} cannot "
                                 "name another place: make a writer per store, or pass paths instead")
            self.settings = dataclasses.replace(self.settings, path=os.fspath(checkpoint_id))
        self._save = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        self.save_started()  # the first call in a save without checkpoint_id=
        # DCP sets its planner up next: refused here if another thread's dcp.save uses it, so that save keeps its
        # state dict
        dcp_internals.check_save_planner_unshared()
        # save_id: chosen by the coordinator after this is asked (it is in the manifest)
        return StorageMeta(checkpoint_id=self.settings.label(), save_id=None)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        settings = self.settings
        if not settings.path and settings.store is None:
            raise ValueError("ZarrWriter needs a path or a store: pass path or store=, or checkpoint_id= to dcp.save")
        if kwargs.get("use_collectives", True) is False:
            # Every rank gets here before anything is written (DCP calls this first on each rank, and in this mode
            # no rank waits for another), so every rank refuses alike.
            raise UnsupportedModeError(_NO_COLLECTIVES)
        # rank: in DCP's process group (torch passes it to a method taking **kwargs)
        self._starting = _Start(is_coordinator, kwargs.get("rank"))
        self._save = None
        self.written_keys = []
        # overwrite=True, said explicitly, also replaces an interrupted save; nothing does by default
        replace_interrupted = settings.overwrite is True
        if is_coordinator and settings.store is not None:
            commit.check_stored(settings.open(), settings.replaces(), replace_interrupted=replace_interrupted)
        elif is_coordinator:
            commit.check_target(settings.path, settings.storage_options, settings.replaces(),
                                retry=settings.retrying, replace_interrupted=replace_interrupted)
        # DCP's own planner (planner=None, or a DefaultSavePlanner that plans as DCP does) plans this save locally,
        # as ZarrSavePlanner would: dcp.save(sd, storage_writer=ZarrWriter(p)) is the line users write. DCP asks
        # it for its plan next.
        call = dcp_internals.dcp_save_call()
        if call is not None:
            dcp_internals.take_over_save(call, rank_plan)

    @step_with_collector_paused
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        start, self._starting = self._starting or _Start(False, None), None
        save: Save
        if isinstance(plan.planner_data, RankState):  # planned here, as ZarrSavePlanner plans: a digest goes to DCP
            save = LocallyPlannedSave(self.settings, plan.planner_data, start.rank, start.is_coordinator)
        else:
            save = DcpPlannedSave(self.settings, start.is_coordinator)
        self._save = save
        # the checkpoint this rank saves to travels with its plan, for the coordinator to compare (same_checkpoint.py)
        return same_checkpoint.named(save.local_plan(plan), same_checkpoint.checkpoint_name(self.path, self.store))

    @step_with_collector_paused
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # before anything is written: the save's global_plans begins it (its staging area, on the coordinator's path)
        locally = planned_locally(plans)
        # every rank must name this checkpoint
        plans = same_checkpoint.checked(plans, saving=True)
        save = self._save
        if save is None:  # a coordinator handed DCP's plans without its own (benchmarks/scale.py's synthetic plans)
            if locally:
                raise RuntimeError("prepare_global_plan of a save planned locally needs this rank's "
                                   "prepare_local_plan first")
            save = self._save = DcpPlannedSave(self.settings, is_coordinator=True)
        return save.global_plans(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._save
        assert save is not None, "write_data of a save without its prepare_local_plan"
        future: Future[list[WriteResult]] = Future()
        try:
            with paused_on_main_thread(save.settings.pauses_collector()):  # gc_pause.py says why
                results = save.write(plan, planner)
            self.written_keys = save.written_keys
            self.reuse_counts = save.reuse_counts
        finally:
            if not save.is_coordinator:  # the coordinator's finish still needs it
                self._save = None  # it holds the planner, and so the state dict: not kept past the save
        future.set_result(results)
        return future

    @step_with_collector_paused
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save, self._save = self._save, None  # it holds the planner, and so the state dict: not kept past the save
        assert save is not None, "finish of a save without its prepare_global_plan"
        save.finish(metadata, results)

    # The target, as given (a LocalStore is its directory's path): read-only, set by reset's checkpoint_id=
    @property
    def path(self) -> str:
        return self.settings.path

    @property
    def store(self):
        return self.settings.store
