"""One rank's reads of a load: each rank for itself (``read_directly``), or shared over the process group where every
rank of the load is in it (``read_shared``, collective/), every checksum checked (store_io/chunks.py)."""

from __future__ import annotations

import io
from functools import partial

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_zarr.collective.needs import needs_digest, rank_needs
from dcp_zarr.collective.read_rounds import read_shared
from dcp_zarr.collective.shared_reads import SharedReads
from dcp_zarr.collective.transfer import Group
from dcp_zarr.format.manifest import Entry, Manifest, TensorEntry
from dcp_zarr.format.torch_arrays import tensor_as_numpy, torch_dtype_from_name
from dcp_zarr.loading.settings import LoadSettings
from dcp_zarr.placement.holdings import group_rank_of
from dcp_zarr.planning import load_plan
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.chunks import RegionReader
from dcp_zarr.store_io.entry_data import stored_value, tensor_reader
from dcp_zarr.store_io.scheduler import run_storage_jobs

Committed = list[tuple[ReadItem, torch.Tensor]]  # tensor items and their destinations, for planner.commit_tensor


class RankReads:
    """A rank's reads from ``storage`` of the store whose manifest is ``manifest``; ``bytes_read`` counts them."""

    def __init__(self, settings: LoadSettings, storage: Storage, manifest: Manifest):
        self.settings = settings
        self.storage = storage
        self.manifest = manifest
        self.bytes_read = 0

    def read_shared(self, items: list[ReadItem], planner: LoadPlanner) -> Committed:
        """This rank's part of a load whose ranks share reads (collective/): every rank of the load gets here."""
        settings, manifest = self.settings, self.manifest
        group = Group(settings.process_group)
        failure: BaseException | None = None
        below = settings.read_once_below if settings.read_once_below is not None else self.storage.aggregate_below
        try:
            needs, alone = rank_needs(items, getattr(planner, "state_dict", {}), _stored_key(planner, manifest),
                                      group_rank_of(settings.process_group), replicas_only=below == 0)
            digest = needs_digest(needs, group.size, (below, settings.exchange_bytes))
        except Exception as exc:  # noqa: BLE001  (this rank raises below, after the others know)
            failure, needs, alone, digest = exc, {}, list(items), b"failed"
        if not group.same_everywhere(digest) or failure is not None:
            if failure is not None:
                raise failure
            return self.read_directly(items, planner)  # the ranks differ: each reads for itself
        shared = SharedReads(needs, manifest.entries, group.size, below, settings.exchange_bytes)
        by_dest = {item.dest_index.fqn: item for item in items if item.type != LoadItemType.BYTE_IO}
        direct = alone + [by_dest[dest] for dest in needs if not shared.shared(dest) and dest in by_dest]
        destination = load_plan.destinations(planner)
        committed: Committed = []
        destinations = {}
        try:  # what fails here is raised on every rank at the first round, so that no rank waits for this one
            committed = self.read_directly(direct, planner)
            self.read_values([i for i in items if i.type == LoadItemType.BYTE_IO], planner)
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
                readers[array] = tensor_reader(self.storage, entry, array,
                                               checked=manifest.checked_copies.get(entry.node))
            return readers[array]

        self.bytes_read += read_shared(shared, group, destinations, reader_of,
                                       lambda array: torch_dtype_from_name(_stored_tensor(manifest, array).dtype),
                                       self.storage, settings.thread_count, failure)
        return committed

    def read_values(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        entries = self.manifest.entries
        for item in items:
            fqn = item.storage_index.fqn
            planner.load_bytes(item, io.BytesIO(value_bytes(self.storage, entries[fqn], fqn,
                                                            self.settings.safe_globals)))

    def read_directly(self, items: list[ReadItem], planner: LoadPlanner) -> Committed:
        """Read ``items`` from storage on this rank alone (values loaded); the tensor items and their destinations,
        for ``planner.commit_tensor`` once every read is done."""
        entries = self.manifest.entries
        tensor_items = [item for item in items if item.type != LoadItemType.BYTE_IO]
        readers = self._tensor_readers(tensor_items)
        self.read_values([item for item in items if item.type == LoadItemType.BYTE_IO], planner)
        destination = load_plan.destinations(planner)
        committed: Committed = []
        jobs = []
        for item in tensor_items:
            entry = entries[item.storage_index.fqn]
            assert isinstance(entry, TensorEntry)  # dcp_metadata made every other entry a bytes entry
            stored_dtype = torch_dtype_from_name(entry.dtype)
            dest, reader = destination(item), readers[item.storage_index.fqn]
            committed.append((item, dest))
            offsets = [a + b for a, b in zip(item.storage_index.offset or (), item.storage_offsets)]
            if dest.device.type == "cpu" and dest.dtype == stored_dtype and dest.dim() > 0:
                # Straight into the destination, in row pieces read concurrently: each item is a whole local shard
                # (one saved chunk per tensor, see dcp_metadata), which would otherwise be one job on one thread.
                jobs += reader.read_jobs(offsets, tensor_as_numpy(dest))
            else:
                jobs.append((dest.numel() * dest.element_size(),
                             partial(_read_into_tensor, reader, stored_dtype, offsets, item.lengths, dest)))
        self.bytes_read += sum(run_storage_jobs(self.storage, jobs, self.settings.thread_count, name="dcp-zarr-read"))
        return committed

    def _tensor_readers(self, items: list[ReadItem]) -> dict[str, RegionReader]:
        """A checked RegionReader per tensor the plan reads, each checked against its array's zarr.json: its copy in
        the root (format/node_copies.py; checked as the manifest was read), or in a store without one the array's own,
        read concurrently (one after another they would be a round trip per tensor on an object store)."""
        storage, entries, checked = self.storage, self.manifest.entries, self.manifest.checked_copies
        fqns = list(dict.fromkeys(item.storage_index.fqn for item in items))
        if all(entries[fqn].node in checked for fqn in fqns):  # no request: made here, not on threads
            return {fqn: tensor_reader(storage, entries[fqn], fqn, checked=checked[entries[fqn].node]) for fqn in fqns}
        found = run_storage_jobs(storage, [(0, partial(tensor_reader, storage, entries[fqn], fqn,
                                                       checked=checked.get(entries[fqn].node))) for fqn in fqns],
                                 self.settings.thread_count, name="dcp-zarr-read")
        return dict(zip(fqns, found))

    def read_entry(self, fqn: str):
        """One saved entry, whole: a tensor at its global shape, or the value."""
        entry = self.manifest.entries[fqn]
        if not isinstance(entry, TensorEntry):
            data = value_bytes(self.storage, entry, fqn, self.settings.safe_globals)
            return torch.load(io.BytesIO(data), weights_only=True)
        tensor = torch.empty(entry.shape, dtype=torch_dtype_from_name(entry.dtype))
        reader = tensor_reader(self.storage, entry, fqn, checked=self.manifest.checked_copies.get(entry.node))
        self.bytes_read += reader.read_into([0] * tensor.dim(), tensor_as_numpy(tensor))
        return tensor


def value_bytes(storage: Storage, entry: Entry, fqn: str, safe_globals: list) -> bytes:
    """A ``torch.save`` stream of the stored value, built only from data that ran no code when read."""
    value = stored_value(storage, entry, fqn, safe_globals, "ZarrReader(..., safe_globals=[...])")
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _region_of(item: ReadItem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The region of the stored array a read item reads (offsets, sizes)."""
    offsets = tuple(a + b for a, b in zip(item.storage_index.offset or (0,) * len(item.lengths), item.storage_offsets))
    return offsets, tuple(int(n) for n in item.lengths)


def _stored_tensor(manifest: Manifest, fqn: str) -> TensorEntry:
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


def _read_into_tensor(reader: RegionReader, stored_dtype: torch.dtype, offsets, lengths, dest: torch.Tensor) -> int:
    """Read straight into ``dest`` when it is a CPU tensor of the stored dtype; otherwise via a staging copy."""
    if dest.device.type == "cpu" and dest.dtype == stored_dtype:
        return reader.read_into(offsets, tensor_as_numpy(dest))
    staging = torch.empty(tuple(lengths), dtype=stored_dtype)
    fetched = reader.read_into(offsets, tensor_as_numpy(staging))
    dest.copy_(staging)
    return fetched
