"""``ZarrReader``: the ``torch.distributed.checkpoint`` StorageReader for stores written by ``ZarrWriter``.

Data path: read_metadata (the root manifest, read once and broadcast where the load runs on several ranks:
loading/root_once.py; DCP Metadata in which each tensor is one chunk, the global array: loading/metadata.py) -> each
rank's read items: one per local shard and tensor, however many ranks saved it, made in arithmetic by DCP's own
planner taken over (set_up_storage_reader, planning/dcp_internals.py) -> read_data (each rank reads only the chunks,
or inner chunks, under its regions, concurrently, checking every checksum, or shares reads over the process group:
loading/rank_reads.py).
Implementation: ``ZarrReader`` is public as ``dcp_zarr.ZarrReader``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_zarr.collective.transfer import DEFAULT_EXCHANGE_BYTES
from dcp_zarr.format.manifest import Manifest
from dcp_zarr.gc_pause import paused_on_main_thread, step_with_collector_paused
from dcp_zarr.loading.metadata import MANIFEST_IN_STORAGE_DATA, dcp_metadata
from dcp_zarr.loading.rank_reads import RankReads
from dcp_zarr.loading.root_once import manifest_read_once
from dcp_zarr.loading.settings import LoadSettings
from dcp_zarr.planning import dcp_internals, load_plan, same_checkpoint
from dcp_zarr.planning.protocol import LoadSummary, LoadTicket
from dcp_zarr.storage import store_objects
from dcp_zarr.storage.retry import Retrying, RetryPolicy
from dcp_zarr.store_io.root_document import read_manifest

__all__ = ["ZarrReader", "MANIFEST_IN_STORAGE_DATA", "dcp_metadata"]


def _rank_and_world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class ZarrReader(StorageReader):
    """Load a checkpoint written by ``ZarrWriter`` at any world size or mesh.

    Args:
        path: the store's local directory or URL; ``dcp.load``'s ``checkpoint_id`` replaces it.
        store: a zarr store object instead of ``path`` (``zarr.storage.ObjectStore``, ``FsspecStore``, ...); each
            rank passes its own.
        storage_options: passed to fsspec for URLs.
        thread_count: concurrent chunk reads per rank.
        safe_globals: extra types that non-tensor values saved as ``torch.save`` bytes may contain (numpy arrays,
            your own classes); passed to ``torch.serialization.safe_globals``. Nothing else from the store is
            ever unpickled.
        retry: the ``RetryPolicy`` of this reader's object-store calls (default: ``storage.retry.DEFAULT_POLICY``).
        process_group: the group ``dcp.load`` runs on (its ``process_group=``; default: the whole world), over which
            reads are shared (collective/).
        read_once: read what several ranks need once: a region several ranks load whole (replicas: HSDP, DDP,
            ``Replicate``, plain tensors) by one of them, and the small pieces of one stored chunk by one rank, then
            sent over the process group to the ranks that need them; the root zarr.json by DCP's coordinator alone.
            False: every rank reads for itself. Default (None): where the storage's default aggregates writes
            (object stores, shared file systems; not a machine's own file system, whose page cache already serves
            a file's bytes once to every process on it, faster than the exchange: storage-traffic.md).
        read_once_below: DTensor pieces smaller than this are read a stored chunk at a time (default: the
            storage's ``aggregate_below``, as ZarrWriter's).
        exchange_bytes: the bytes a rank reads for others in one round of shared reads.
    """

    def __init__(self, path: str | os.PathLike = "", *, store=None, storage_options: dict | None = None,
                 thread_count: int = 4,
                 safe_globals: list | None = None, retry: RetryPolicy | None = None, process_group=None,
                 read_once: bool | None = None, read_once_below: int | None = None,
                 exchange_bytes: int = DEFAULT_EXCHANGE_BYTES):
        path, store = store_objects.resolve("ZarrReader", path, store, writable=False)
        # Made once, checked as it is made; every load of this reader runs with it (reset's checkpoint_id= gives a
        # copy with that path). Its Retrying is shared by every storage this reader opens (retry.py).
        self.settings = LoadSettings(
            path=path, store=store, storage_options=storage_options, thread_count=thread_count,
            safe_globals=list(safe_globals or []), process_group=process_group, read_once=read_once,
            read_once_below=read_once_below, exchange_bytes=exchange_bytes, retrying=Retrying(retry))
        self.manifest: Manifest | None = None  # the checkpoint's, from read_metadata until the next reset
        self.bytes_read = 0  # by every load and read_entry of this reader
        self._kept_items: list = []  # this rank's read items, from prepare_local_plan to read_data (not sent)
        self._metadata_failure: BaseException | None = None  # what read_metadata raised, until it is called again

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            if self.store is not None:
                raise ValueError(f"ZarrReader(store=...) reads its store; checkpoint_id={checkpoint_id!r} cannot name "
                                 "another place: make a reader per store, or pass paths instead")
            self.settings = dataclasses.replace(self.settings, path=os.fspath(checkpoint_id))
        self.manifest = None
        self._kept_items = []

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    @step_with_collector_paused
    def read_metadata(self, *args, **kwargs) -> Metadata:
        settings = self.settings
        failed, self._metadata_failure = self._metadata_failure, None
        if failed is not None and kwargs.get("rank") is not None:
            # DCP's second try, for metadata of this rank's own, once this rank's read failed: a store has none, and
            # the read would join the root's broadcast (root_once.py) that the ranks whose read succeeded have left,
            # so this rank would wait for them forever. The same failure, at once: DCP fails the load on every rank.
            raise failed
        try:
            self.manifest = manifest_read_once(settings)
        except Exception as exc:
            carried = dcp_internals.reported_by_dcp_load(exc)  # torch 2.11 and 2.12 drop the reason otherwise
            self._metadata_failure = carried
            if carried is exc:
                raise
            raise carried from exc
        metadata = dcp_metadata(self.manifest)
        metadata.storage_meta = StorageMeta(checkpoint_id=settings.label(), load_id=self.manifest.save_id)
        metadata.storage_data = {MANIFEST_IN_STORAGE_DATA: self.manifest}
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        if self.manifest is None:
            self.manifest = read_manifest(self.settings.open())
        planner = dcp_internals.dcp_load_planner()  # DCP plans next: its own planner, in arithmetic
        if planner is not None:
            dcp_internals.take_over_load(planner, metadata, load_plan.local_read_items)

    @step_with_collector_paused
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Loads are planned locally: each rank's read items come from the manifest and its own state dict, and DCP's
        # global load plan (DefaultLoadPlanner's, ZarrLoadPlanner's) passes them through untouched. So they stay on
        # the rank, and the plan DCP gathers to the coordinator and scatters back carries none: a few hundred bytes
        # per rank instead of one pickled ReadItem per local shard and tensor.
        self._kept_items = list(plan.items)
        seen = LoadSummary(*_rank_and_world(self.settings.process_group)) if self.settings.shares_reads() else None
        # with the checkpoint this rank loads from, for the coordinator to compare (same_checkpoint.py)
        return same_checkpoint.named(dataclasses.replace(plan, items=[], storage_data=seen),
                                     same_checkpoint.checkpoint_name(self.path, self.store))

    @step_with_collector_paused
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank must name this checkpoint: refused here, before read_data reads any chunk (each rank has read
        # at most its own root zarr.json, in read_metadata)
        plans = same_checkpoint.checked(plans, saving=False)
        # Reads are shared only when every rank of DCP's load is the same rank of this reader's group (so their
        # collectives meet): not for a load on one rank alone (no_dist=True), nor with a process group other than
        # the reader's, where each rank reads for itself.
        summaries = [plan.storage_data for plan in plans]
        together = len(plans) > 1 and all(isinstance(s, LoadSummary) and s == (r, len(plans))
                                          for r, s in enumerate(summaries))
        if len(plans) > 1 and not together and all(isinstance(s, LoadSummary) for s in summaries):
            warnings.warn(f"ZarrReader: dcp.load runs on {len(plans)} ranks, not on the reader's process group of "
                          f"{summaries[0].world_size}: every rank reads for itself. Pass ZarrReader(process_group=...) "
                          "the group given to dcp.load to share reads", stacklevel=2)
        return [dataclasses.replace(plan, storage_data=LoadTicket(together)) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        together = isinstance(plan.storage_data, LoadTicket) and plan.storage_data.together
        # A planner whose global plan gives a rank items of its own is followed; otherwise the rank's kept items.
        items, self._kept_items = plan.items or self._kept_items, []
        reads = self._reads()
        try:
            with paused_on_main_thread(reads.settings.pauses_collector()):  # gc_pause.py says why
                committed = reads.read_shared(items, planner) if together else reads.read_directly(items, planner)
                for item, dest in committed:
                    planner.commit_tensor(item, dest)
        finally:
            self.bytes_read += reads.bytes_read
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def read_entry(self, fqn: str):
        """One saved entry, whole, outside ``dcp.load`` (no collectives): a tensor at its global shape, or the value."""
        if self.manifest is None:
            self.read_metadata()
        reads = self._reads()
        try:
            return reads.read_entry(fqn)
        finally:
            self.bytes_read += reads.bytes_read

    def _reads(self) -> RankReads:
        """This rank's reads of the load under way: DCP calls read_metadata or set_up_storage_reader (each reads the
        manifest) first."""
        assert self.manifest is not None, "read_data before read_metadata or set_up_storage_reader"
        settings = self.settings
        return RankReads(settings, settings.open(), self.manifest)

    # The source, as given (a LocalStore is its directory's path): read-only, set by reset's checkpoint_id=
    @property
    def path(self) -> str:
        return self.settings.path

    @property
    def store(self):
        return self.settings.store
