"""``ZarrReader``: the ``torch.distributed.checkpoint`` StorageReader for stores written by ``ZarrWriter``.

Data path: read_metadata (the root manifest, manifest.py -> DCP Metadata in which each tensor is one chunk, the
global array) -> DCP plans which regions each rank needs: one read item per local shard and tensor, however many
ranks saved it -> read_data (each rank reads only the chunks, or inner chunks, under its regions, concurrently,
checking every checksum; chunk_io.py).
"""

from __future__ import annotations

import dataclasses
import io
import os
from functools import partial

import torch
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

from dcp_zarr.chunk_io import RegionReader
from dcp_zarr.entry_reader import stored_value, tensor_reader
from dcp_zarr.format.dtypes import tensor_as_numpy, torch_dtype_from_name
from dcp_zarr.format.manifest import Entry, Manifest, TensorEntry, read_manifest
from dcp_zarr.scheduler import run_jobs
from dcp_zarr.storage import Storage, open_storage, store_objects
from dcp_zarr.storage.retry import Retrying, RetryPolicy

# A large region is read as concurrent row pieces of about this size (whole chunk rows each).
_READ_PIECE_BYTES = 4 << 20

# Key of the manifest in ``Metadata.storage_data``: ZarrLoadPlanner reads the optimizer param tables from it.
MANIFEST_IN_STORAGE_DATA = "dcp_zarr_manifest"


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
    """

    def __init__(self, path: str | os.PathLike = "", *, store=None, storage_options: dict | None = None,
                 thread_count: int = 4,
                 safe_globals: list | None = None, retry: RetryPolicy | None = None):
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

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.manifest = read_manifest(self._storage())
        metadata = dcp_metadata(self.manifest)
        checkpoint_id = store_objects.label(self.store) if self.store is not None else self.path
        metadata.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, load_id=self.manifest.save_id)
        metadata.storage_data = {MANIFEST_IN_STORAGE_DATA: self.manifest}
        return metadata

    def _read_manifest(self) -> Manifest:
        """The manifest of a load under way: DCP calls read_metadata or set_up_storage_reader (each reads it) first."""
        assert self.manifest is not None, "read_data before read_metadata or set_up_storage_reader"
        return self.manifest

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        if self.manifest is None:
            self.manifest = read_manifest(self._storage())

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Loads are planned locally: each rank's read items come from the manifest and its own state dict, and DCP's
        # global load plan (DefaultLoadPlanner's, ZarrLoadPlanner's) passes them through untouched. So they stay on
        # the rank, and the plan DCP gathers to the coordinator and scatters back carries none: a few hundred bytes
        # per rank instead of one pickled ReadItem per local shard and tensor.
        self._read_items = list(plan.items)
        return dataclasses.replace(plan, items=[])

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _tensor_readers(self, storage: Storage, plan: LoadPlan) -> dict[str, RegionReader]:
        """A checked RegionReader per tensor the plan reads, each checked against its array's zarr.json: the copy in
        the root's consolidated metadata, or in a store without one the array's own, read concurrently (one after
        another they would be a round trip per tensor: seconds for a few hundred tensors on an object store)."""
        manifest = self._read_manifest()
        entries, documents = manifest.entries, manifest.node_documents
        fqns = list(dict.fromkeys(item.storage_index.fqn for item in plan.items if item.type != LoadItemType.BYTE_IO))
        found = run_jobs([(0, partial(tensor_reader, storage, entries[fqn], fqn, documents.get(entries[fqn].node)))
                          for fqn in fqns],
                         storage.requests_in_flight(self.thread_count), storage.batch_bytes, name="dcp-zarr-read")
        return dict(zip(fqns, found))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # A planner whose global plan gives a rank items of its own is followed; otherwise the rank's kept items.
        if not plan.items:
            plan = dataclasses.replace(plan, items=self._read_items)
        storage = self._storage()
        entries = self._read_manifest().entries
        readers = self._tensor_readers(storage, plan)
        tensor_items: list[tuple[ReadItem, torch.Tensor, RegionReader, torch.dtype]] = []
        for item in plan.items:
            entry = entries[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                value = _value_bytes(storage, entry, item.storage_index.fqn, self.safe_globals)
                planner.load_bytes(item, io.BytesIO(value))
                continue
            assert isinstance(entry, TensorEntry)  # dcp_metadata made every other entry a bytes entry
            stored_dtype = torch_dtype_from_name(entry.dtype)
            tensor_items.append((item, planner.resolve_tensor(item).detach(), readers[item.storage_index.fqn],
                                 stored_dtype))

        jobs = []
        for item, dest, reader, stored_dtype in tensor_items:
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
        for item, dest, _, _ in tensor_items:
            planner.commit_tensor(item, dest)
        future: Future[None] = Future()
        future.set_result(None)
        return future

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
        reader = tensor_reader(storage, entry, fqn, self.manifest.node_documents.get(entry.node))
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
                properties=TensorProperties(
                    dtype=torch_dtype_from_name(entry.dtype), requires_grad=entry.requires_grad),
                size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
            )
        else:
            state_dict_metadata[fqn] = BytesStorageMetadata()
    planner_data = {fqn: entry.path for fqn, entry in manifest.entries.items()}
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data or None, storage_data=None)


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
