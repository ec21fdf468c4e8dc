"""``ZarrReader``: the ``torch.distributed.checkpoint`` StorageReader for stores written by ``ZarrWriter``.

Data path: read_metadata (the root manifest, manifest.py -> DCP Metadata in which each tensor is one chunk, the
global array) -> each rank's read items: one per local shard and tensor, however many ranks saved it, made in
arithmetic by DCP's own planner taken over (set_up_storage_reader, planning/load_plan.py) -> read_data (each rank
reads only the chunks, or inner chunks, under its regions, concurrently, checking every checksum;
store_io/chunks.py).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_zarr.collective.load_call import dcp_load_planner, dcp_load_wrapper
from dcp_zarr.collective.needs import needs_digest, rank_needs
from dcp_zarr.collective.read_rounds import read_shared
from dcp_zarr.collective.shared_reads import SharedReads
from dcp_zarr.collective.transfer import Group
from dcp_zarr.collector import paused_on_main_thread, step_with_collector_paused
from dcp_zarr.errors import ZarrCheckpointError
from dcp_zarr.format.manifest import Entry, Manifest, TensorEntry, manifest_of_root
from dcp_zarr.format.torch_arrays import tensor_as_numpy, torch_dtype_from_name
from dcp_zarr.placement.holdings import group_rank_of
from dcp_zarr.planning import load_plan
from dcp_zarr.storage import Storage, default_aggregate_below, is_local, open_storage, store_objects
from dcp_zarr.storage.retry import Retrying, RetryPolicy
from dcp_zarr.store_io.chunks import RegionReader
from dcp_zarr.store_io.entry_data import stored_value, tensor_reader
from dcp_zarr.store_io.root_document import read_manifest, read_root
from dcp_zarr.store_io.scheduler import run_jobs

# A large region is read as concurrent row pieces of about this size (whole chunk rows each).
_READ_PIECE_BYTES = 4 << 20

# Key of the manifest in ``Metadata.storage_data``: ZarrLoadPlanner reads the optimizer param tables from it.
MANIFEST_IN_STORAGE_DATA = "dcp_zarr_manifest"
DEFAULT_EXCHANGE_BYTES = 256 << 20
# torch 2.15's TensorProperties hold the strides of the tensor a chunk was saved from; earlier ones have no field.
_PROPERTIES_HOLD_STRIDES = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}


class LoadSummary(NamedTuple):
    """A rank's plan as DCP gathers it: its rank and world in the reader's process group, nothing per item."""

    rank: int
    world_size: int


class LoadTicket(NamedTuple):
    """The coordinator's answer: whether the ranks share reads (every rank of the load is in the reader's group)."""

    together: bool


def _rank_and_world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _sendable(exc: Exception) -> Exception:
    """``exc``, or an error of the same text where it cannot be pickled to the other ranks."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return ZarrCheckpointError(f"{type(exc).__name__}: {exc}")


def _region_of(item: ReadItem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The region of the stored array a read item reads (offsets, sizes)."""
    offsets = tuple(a + b for a, b in zip(item.storage_index.offset or (0,) * len(item.lengths), item.storage_offsets))
    return offsets, tuple(int(n) for n in item.lengths)


def _tensor_entry(manifest: Manifest, fqn: str) -> TensorEntry:
    entry = manifest.entries[fqn]
    assert isinstance(entry, TensorEntry)  # shared reads are of tensor entries only
    return entry


def _stored_key(planner, manifest: Manifest):
    """The stored entry a state-dict key loads from, for keys this rank has no items for (an empty box): the
    planner's own answer where it has one (ZarrLoadPlanner's key translation), else the key, if it is stored."""
    own = getattr(planner, "stored_key", None)
    if own is not None:
        return own
    return lambda key: key if key in manifest.entries else None


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
        if read_once_below is not None and (type(read_once_below) is not int or read_once_below < 0):
            raise ValueError(f"read_once_below={read_once_below!r}: expected a number of bytes >= 0, or None for the "
                             "storage's default")
        if type(exchange_bytes) is not int or exchange_bytes < 1:
            raise ValueError(f"exchange_bytes={exchange_bytes!r}: expected a number of bytes >= 1")
        if read_once is not None and type(read_once) is not bool:  # "false" is truthy: never guess
            raise ValueError(f"read_once={read_once!r}: expected True, False or None for the storage's default")
        self.process_group = process_group
        self.read_once = read_once
        self.read_once_below = read_once_below
        self.exchange_bytes = exchange_bytes
        self.path, self.store = store_objects.resolve("ZarrReader", path, store, writable=False)
        self.retry = retry
        self._retrying = Retrying(retry)  # shared by every storage this reader opens (retry.py)
        self.safe_globals = list(safe_globals or [])
        self.storage_options = storage_options
        self.thread_count = max(1, int(thread_count))
        self.manifest: Manifest | None = None
        self.bytes_read = 0
        self._read_items: list[ReadItem] = []  # this rank's read items, kept here instead of sent (prepare_local_plan)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            if self.store is not None:
                raise ValueError(f"ZarrReader(store=...) reads its store; checkpoint_id={checkpoint_id!r} cannot name "
                                 "another place: make a reader per store, or pass paths instead")
            self.path = os.fspath(checkpoint_id)
        self.manifest = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def _storage(self) -> Storage:
        if self.store is not None:
            return store_objects.open_store(self.store, self._retrying)
        if not self.path:
            raise ValueError("ZarrReader needs a path or a store: pass path or store=, or checkpoint_id= to dcp.load")
        return open_storage(self.path, self.storage_options, read_only=True, retry=self._retrying)

    @step_with_collector_paused
    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.manifest = self._manifest_read_once()
        metadata = dcp_metadata(self.manifest)
        checkpoint_id = store_objects.label(self.store) if self.store is not None else self.path
        metadata.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, load_id=self.manifest.save_id)
        metadata.storage_data = {MANIFEST_IN_STORAGE_DATA: self.manifest}
        return metadata

    def _manifest_read_once(self) -> Manifest:
        """The manifest, from the root zarr.json read by DCP's coordinator alone and broadcast to the other ranks
        when DCP's load runs on several (collective/load_call.py), else read here.

        The coordinator decides for every rank whether it shares the root (its ``_shares_reads``), and every rank
        of the load joins the broadcast either way: ranks that decided apart (one sees the path on a machine's own
        file system, another on NFS) would otherwise wait in different collectives. On a machine's own file
        system that broadcast carries a few bytes and every rank reads the root itself."""
        load = dcp_load_wrapper()
        if load is None or not load.use_dist or load.get_world_size() < 2:
            return read_manifest(self._storage())
        payload: tuple | None = None
        if load.is_coordinator:
            try:
                if self._shares_reads():
                    storage = self._storage()
                    payload = ("root", read_root(storage), storage.url)
                else:
                    payload = ("each",)
            except Exception as exc:  # noqa: BLE001  (every rank raises it, below)
                payload = ("error", _sendable(exc))
        payload = load.broadcast_object(payload)
        assert payload is not None
        if payload[0] == "error":
            raise payload[1]
        if payload[0] == "each":
            return read_manifest(self._storage())
        return manifest_of_root(payload[1], payload[2])

    def _shares_reads(self) -> bool:
        """``read_once``, or by default whether the storage's default aggregates. Ranks may decide apart (each sees
        its own mount): the coordinator's decides the root's broadcast, and reads are shared only where every
        rank's does (prepare_global_plan)."""
        if self.read_once is not None:
            return self.read_once
        return default_aggregate_below(self.path, self.store, self._retrying) > 0  # object stores, shared FS

    def _read_manifest(self) -> Manifest:
        """The manifest of a load under way: DCP calls read_metadata or set_up_storage_reader (each reads it) first."""
        assert self.manifest is not None, "read_data before read_metadata or set_up_storage_reader"
        return self.manifest

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        if self.manifest is None:
            self.manifest = read_manifest(self._storage())
        planner = dcp_load_planner()  # DCP plans next: its own planner makes the read items in arithmetic
        if planner is not None:
            load_plan.take_over(planner, metadata)

    @step_with_collector_paused
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Loads are planned locally: each rank's read items come from the manifest and its own state dict, and DCP's
        # global load plan (DefaultLoadPlanner's, ZarrLoadPlanner's) passes them through untouched. So they stay on
        # the rank, and the plan DCP gathers to the coordinator and scatters back carries none: a few hundred bytes
        # per rank instead of one pickled ReadItem per local shard and tensor.
        self._read_items = list(plan.items)
        seen = LoadSummary(*_rank_and_world(self.process_group)) if self._shares_reads() else None
        return dataclasses.replace(plan, items=[], storage_data=seen)

    @step_with_collector_paused
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Reads are shared only when every rank of DCP's load is the same rank of this reader's group (so their
        # collectives meet): not for a load on one rank alone (no_dist=True), nor with a process group other than
        # the reader's, which then reads as before, each rank for itself.
        summaries = [plan.storage_data for plan in plans]
        together = len(plans) > 1 and all(isinstance(s, LoadSummary) and s == (r, len(plans))
                                          for r, s in enumerate(summaries))
        if len(plans) > 1 and not together and all(isinstance(s, LoadSummary) for s in summaries):
            warnings.warn(f"ZarrReader: dcp.load runs on {len(plans)} ranks, not on the reader's process group of "
                          f"{summaries[0].world_size}: every rank reads for itself. Pass ZarrReader(process_group=...) "
                          "the group given to dcp.load to share reads", stacklevel=2)
        return [dataclasses.replace(plan, storage_data=LoadTicket(together)) for plan in plans]

    def _tensor_readers(self, storage: Storage, items: list[ReadItem]) -> dict[str, RegionReader]:
        """A checked RegionReader per tensor the plan reads, each checked against its array's zarr.json: the copy in
        the root's consolidated metadata (checked as the manifest was read), or in a store without one the array's
        own, read concurrently (one after another they would be a round trip per tensor: seconds for a few hundred
        tensors on an object store)."""
        manifest = self._read_manifest()
        entries, checked = manifest.entries, manifest.checked_copies
        fqns = list(dict.fromkeys(item.storage_index.fqn for item in items))
        if all(entries[fqn].node in checked for fqn in fqns):  # no request: made here, not on threads
            return {fqn: tensor_reader(storage, entries[fqn], fqn, checked=checked[entries[fqn].node]) for fqn in fqns}
        found = run_jobs([(0, partial(tensor_reader, storage, entries[fqn], fqn,
                                      checked=checked.get(entries[fqn].node))) for fqn in fqns],
                         storage.requests_in_flight(self.thread_count), storage.batch_bytes, name="dcp-zarr-read")
        return dict(zip(fqns, found))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        together = isinstance(plan.storage_data, LoadTicket) and plan.storage_data.together
        # A planner whose global plan gives a rank items of its own is followed; otherwise the rank's kept items.
        if not plan.items:
            plan = dataclasses.replace(plan, items=self._read_items)
        storage = self._storage()
        with paused_on_main_thread(self.store is None and is_local(self.path)):  # collector.py says why
            if together:
                self._read_shared(storage, plan.items, planner)
            else:
                committed = self._read_directly(storage, plan.items, planner)
                for item, dest in committed:
                    planner.commit_tensor(item, dest)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_shared(self, storage: Storage, items: list[ReadItem], planner: LoadPlanner) -> None:
        """This rank's part of a load whose ranks share reads (collective/): every rank of the load gets here."""
        group = Group(self.process_group)
        manifest = self._read_manifest()
        failure: BaseException | None = None
        below = self.read_once_below if self.read_once_below is not None else storage.aggregate_below
        try:
            needs, alone = rank_needs(items, getattr(planner, "state_dict", {}), _stored_key(planner, manifest),
                                      group_rank_of(self.process_group), replicas_only=below == 0)
            digest = needs_digest(needs, group.size, (below, self.exchange_bytes))
        except Exception as exc:  # noqa: BLE001  (this rank raises below, after the others know)
            failure, needs, alone, digest = exc, {}, list(items), b"failed"
        if not group.same_everywhere(digest) or failure is not None:
            if failure is not None:
                raise failure
            committed = self._read_directly(storage, items, planner)  # the ranks differ: each reads for itself
        else:
            shared = SharedReads(needs, manifest.entries, group.size, below, self.exchange_bytes)
            by_dest = {item.dest_index.fqn: item for item in items if item.type != LoadItemType.BYTE_IO}
            direct = alone + [by_dest[dest] for dest in needs if not shared.shared(dest) and dest in by_dest]
            destination = load_plan.destinations(planner)
            committed = []
            destinations = {}
            try:  # what fails here is raised on every rank at the first round, so that no rank waits for this one
                committed = self._read_directly(storage, direct, planner)
                self._read_bytes(storage, [i for i in items if i.type == LoadItemType.BYTE_IO], planner)
                for key in needs:
                    if shared.shared(key) and key in by_dest:
                        item = by_dest[key]
                        tensor = destination(item)
                        destinations[key] = (tensor, _region_of(item))
                        committed.append((item, tensor))
            except Exception as exc:  # noqa: BLE001
                failure = exc
            readers: dict[str, RegionReader] = {}

            def reader_of(array: str) -> RegionReader:
                if array not in readers:
                    entry = manifest.entries[array]
                    readers[array] = tensor_reader(storage, entry, array,
                                                   checked=manifest.checked_copies.get(entry.node))
                return readers[array]

            self.bytes_read += read_shared(shared, group, destinations, reader_of,
                                           lambda array: torch_dtype_from_name(_tensor_entry(manifest, array).dtype),
                                           storage, self.thread_count, failure)
        for item, tensor in committed:
            planner.commit_tensor(item, tensor)

    def _read_bytes(self, storage: Storage, items: list[ReadItem], planner: LoadPlanner) -> None:
        entries = self._read_manifest().entries
        for item in items:
            value = _value_bytes(storage, entries[item.storage_index.fqn], item.storage_index.fqn, self.safe_globals)
            planner.load_bytes(item, io.BytesIO(value))

    def _read_directly(self, storage: Storage, items: list[ReadItem], planner: LoadPlanner
                       ) -> list[tuple[ReadItem, torch.Tensor]]:
        """Read ``items`` from storage on this rank alone (values loaded); the tensor items and their destinations,
        for ``planner.commit_tensor`` once every read is done."""
        entries = self._read_manifest().entries
        tensor_items = [item for item in items if item.type != LoadItemType.BYTE_IO]
        readers = self._tensor_readers(storage, tensor_items)
        self._read_bytes(storage, [item for item in items if item.type == LoadItemType.BYTE_IO], planner)
        reads: list[tuple[ReadItem, torch.Tensor, RegionReader, torch.dtype]] = []
        destination = load_plan.destinations(planner)
        for item in tensor_items:
            entry = entries[item.storage_index.fqn]
            assert isinstance(entry, TensorEntry)  # dcp_metadata made every other entry a bytes entry
            stored_dtype = torch_dtype_from_name(entry.dtype)
            reads.append((item, destination(item), readers[item.storage_index.fqn], stored_dtype))

        jobs = []
        for item, dest, reader, stored_dtype in reads:
            offsets = [a + b for a, b in zip(item.storage_index.offset or (), item.storage_offsets)]
            if dest.device.type == "cpu" and dest.dtype == stored_dtype and dest.dim() > 0:
                # Straight into the destination, in row pieces read concurrently: each item is a whole local shard
                # (one saved chunk per tensor, see dcp_metadata), which would otherwise be one job on one thread.
                target = tensor_as_numpy(dest)
                row_bytes = target[:1].nbytes
                for lo, hi in reader.row_pieces(offsets, target.shape, _READ_PIECE_BYTES):
                    jobs.append(((hi - lo) * row_bytes,
                                 partial(reader.read_into, [offsets[0] + lo, *offsets[1:]], target[lo:hi])))
            else:
                jobs.append((dest.numel() * dest.element_size(),
                             partial(_read_into_tensor, reader, stored_dtype, offsets, item.lengths, dest)))
        self.bytes_read += sum(run_jobs(jobs, storage.requests_in_flight(self.thread_count), storage.batch_bytes,
                                        name="dcp-zarr-read", max_bytes_in_flight=storage.max_bytes_in_flight))
        return [(item, dest) for item, dest, _, _ in reads]

    def read_entry(self, fqn: str):
        """One saved entry, whole, outside ``dcp.load`` (no collectives): a tensor at its global shape, or the value."""
        if self.manifest is None:
            self.read_metadata()
        assert self.manifest is not None
        storage = self._storage()
        entry = self.manifest.entries[fqn]
        if not isinstance(entry, TensorEntry):
            return torch.load(io.BytesIO(_value_bytes(storage, entry, fqn, self.safe_globals)), weights_only=True)
        tensor = torch.empty(entry.shape, dtype=torch_dtype_from_name(entry.dtype))
        reader = tensor_reader(storage, entry, fqn, checked=self.manifest.checked_copies.get(entry.node))
        self.bytes_read += reader.read_into([0] * tensor.dim(), tensor_as_numpy(tensor))
        return tensor


def dcp_metadata(manifest: Manifest) -> Metadata:
    """DCP's Metadata for a load, rebuilt from JSON (no pickle).

    Each tensor is presented as one chunk, the global array: DCP's planner then gives every rank one read item per
    local shard, whatever world size saved it, and ``read_data`` maps each item's region onto the zarr chunks (and
    inner chunks) under it. Listing the saved boxes instead would make every rank's plan O(saving ranks x tensors).
    """
    state_dict_metadata: dict = {}
    for fqn, entry in manifest.entries.items():
        if isinstance(entry, TensorEntry):
            shape = torch.Size(entry.shape)
            state_dict_metadata[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype_from_name(entry.dtype),
                                            requires_grad=entry.requires_grad, **_strides(shape)),
                size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
            )
        else:
            state_dict_metadata[fqn] = BytesStorageMetadata()
    planner_data = {fqn: entry.path for fqn, entry in manifest.entries.items()}
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data or None, storage_data=None)


def _strides(shape: torch.Size) -> dict[str, Any]:
    """``strides=`` where torch's TensorProperties have them: the one chunk presented is the array at its global shape,
    in C order, so ``torch.empty(shape).stride()``, which DCP's own metadata holds for a contiguous tensor saved whole.
    (For a sharded one, DCP's holds the strides of the first saving rank's local shard: a store does not record how
    the saving ranks held their tensors, nor does what a load reads depend on it.)"""
    if not _PROPERTIES_HOLD_STRIDES:
        return {}
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)  # torch's rule: a dimension of size 0 strides as one of size 1
    return {"strides": tuple(reversed(strides))}


def _read_into_tensor(reader: RegionReader, stored_dtype: torch.dtype, offsets, lengths, dest: torch.Tensor) -> int:
    """Read straight into ``dest`` when it is a CPU tensor of the stored dtype; otherwise via a staging copy."""
    if dest.device.type == "cpu" and dest.dtype == stored_dtype:
        return reader.read_into(offsets, tensor_as_numpy(dest))
    staging = torch.empty(tuple(lengths), dtype=stored_dtype)
    fetched = reader.read_into(offsets, tensor_as_numpy(staging))
    dest.copy_(staging)
    return fetched


def _value_bytes(storage: Storage, entry: Entry, fqn: str, safe_globals: list) -> bytes:
    """A ``torch.save`` stream of the stored value, built only from data that ran no code when read."""
    value = stored_value(storage, entry, fqn, safe_globals, "ZarrReader(..., safe_globals=[...])")
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
