"""Reading a checkpoint without a process group: list its entries, read one tensor (or part of one), load it all.

    ckpt = open_checkpoint("ckpt.zarr")
    ckpt.entries["model.embed.weight"].shape          # metadata only
    ckpt.read_tensor("model.embed.weight", region=(slice(0, 8),))   # reads only the chunks under rows 0..7
    state = ckpt.load_full_state_dict()               # {"model": {...}, "optim": {...}}, unsharded

Everything goes through the same checked paths as ``ZarrReader`` (``store_io/chunks.RegionReader``): every chunk read is
verified against its crc32c, and non-tensor values are only ever ``torch.load``-ed with ``weights_only=True``. Regions
are read as ``ZarrReader`` reads them too: in row pieces (``RegionReader.read_jobs``) on ``store_io/scheduler``'s
threads, within the storage's requests and bytes in flight.

Opening, listing and ``read_array`` (numpy) never import torch, so ``dcp-zarr inspect``, ``verify`` and ``diff`` run
where torch is not installed, and start in well under a second where it is. Only what returns torch objects
(``read_tensor``, ``load_full_state_dict``, ``Entry.dtype``, decoding ``torch.save`` values) imports it.
Implementation: its public names (``open_checkpoint``, ``load_full_state_dict``, ...) are in ``dcp_zarr``.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import EllipsisType
from typing import TYPE_CHECKING

import numpy as np

from dcp_zarr.errors import NotACheckpointError
from dcp_zarr.format.manifest import OBJECT, TENSOR, VALUE, Manifest, ObjectEntry, TensorEntry, stored_numpy_dtype
from dcp_zarr.format.manifest import Entry as ManifestEntry
from dcp_zarr.optim.wrapper_names import explain_missing_name
from dcp_zarr.progress import progress_bar
from dcp_zarr.storage import Storage, directory_of, open_storage, store_objects
from dcp_zarr.storage.retry import RetryPolicy
from dcp_zarr.store_io.chunks import RegionReader
from dcp_zarr.store_io.entry_data import stored_object_bytes, stored_value, tensor_reader
from dcp_zarr.store_io.root_document import holds_dcp_checkpoint, read_manifest
from dcp_zarr.store_io.scheduler import run_storage_jobs

if TYPE_CHECKING:
    import torch

# A region is basic indexing with step 1: a tuple of slices, ints and at most one Ellipsis (``(slice(0, 8), 3)``).
# A basic-slicing region: one index, or a tuple (or list) of them; region_box also takes 0-d integer tensors.
Region = tuple | list | slice | int | EllipsisType


@dataclass(frozen=True)
class Entry:
    """One state-dict entry as the checkpoint stores it (metadata only; nothing is read to build it)."""

    fqn: str  # DCP's flattened key, e.g. "optim.state.layers.0.w.exp_avg"
    path: tuple  # the nested state-dict path, e.g. ("optim", "state", "layers.0.w", "exp_avg"); ints index lists
    kind: str  # "tensor", "value" (JSON held in the manifest) or "object" (torch.save bytes)
    node: str  # the zarr node, e.g. "optim/state/layers.0.w/exp_avg"
    nbytes: int
    dtype_name: str | None = None  # torch's name, "torch.bfloat16", as the manifest records it (no torch needed)
    shape: tuple[int, ...] | None = None
    chunk_shape: tuple[int, ...] | None = None
    inner_chunk_rows: int = 0
    saved_shards: int = 0  # non-empty boxes the saving ranks held
    source: dict = field(default_factory=dict)  # {"type": "dtensor", "placements": [...], ...}
    # the codec of a compressed array's chunks, as its zarr.json names it ({"name": "blosc", ...}); None: as they are
    codec: dict | None = None
    # a one-element tensor kept in its array's fill_value, with no chunk stored (format 7): the element; else None
    fill: bool | int | float | None = None

    @property
    def is_tensor(self) -> bool:
        return self.kind == TENSOR

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype of a tensor entry (imports torch; ``dtype_name`` and ``numpy_dtype`` do not)."""
        if self.dtype_name is None:
            return None
        from dcp_zarr.format.torch_arrays import torch_dtype_from_name

        return torch_dtype_from_name(self.dtype_name)

    @property
    def numpy_dtype(self) -> np.dtype | None:
        """The numpy dtype ``read_array`` returns (ml_dtypes' for bfloat16 and float8)."""
        return None if self.dtype_name is None else stored_numpy_dtype(self.dtype_name)

    @classmethod
    def from_manifest(cls, stored: ManifestEntry) -> Entry:
        if not isinstance(stored, TensorEntry):
            nbytes = stored.nbytes if isinstance(stored, ObjectEntry) else 0
            return cls(fqn=stored.fqn, path=stored.path, kind=stored.kind, node=stored.node, nbytes=nbytes)
        return cls(
            fqn=stored.fqn, path=stored.path, kind=TENSOR, node=stored.node,
            nbytes=math.prod(stored.shape) * stored_numpy_dtype(stored.dtype).itemsize, dtype_name=stored.dtype,
            shape=stored.shape,
            chunk_shape=stored.chunk_shape or stored.shape, inner_chunk_rows=stored.inner_chunk_rows,
            saved_shards=stored.saved_shards, source=dict(stored.source),
            codec=None if stored.codec is None else stored.codec.to_json(), fill=stored.fill,
        )


class Checkpoint:
    """A complete dcp_zarr checkpoint opened for reading. Cheap to create: only the root zarr.json is read."""

    def __init__(self, storage: Storage, manifest: Manifest, *, thread_count: int = 8,
                 safe_globals: list | None = None):
        self.storage = storage
        self.manifest = manifest
        self.thread_count = max(1, int(thread_count))
        self.safe_globals = list(safe_globals or [])
        self.entries: dict[str, Entry] = {fqn: Entry.from_manifest(stored) for fqn, stored in manifest.entries.items()}
        self._by_node = {entry.node: entry for entry in self.entries.values()}
        self._readers: dict[str, RegionReader] = {}

    # -- what the manifest says -------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def saved_world_size(self) -> int:
        return self.manifest.saved_world_size

    @property
    def state_dict_type(self) -> str:
        return self.manifest.state_dict_type

    @property
    def meshes(self) -> list[dict]:
        return list(self.manifest.meshes)

    @property
    def versions(self) -> dict:
        return dict(self.manifest.versions)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries or name in self._by_node

    def entry(self, name: str | Entry) -> Entry:
        """The entry named by its flattened key (``model.w``) or its zarr node (``model/w``)."""
        if isinstance(name, Entry):
            return name
        found = self.entries.get(name) or self._by_node.get(name)
        if found is not None:
            return found
        hint = explain_missing_name(name, self.entries)
        if hint is None:
            close = difflib.get_close_matches(name, list(self.entries), n=3)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"it has {len(self.entries)} entries"
        raise KeyError(f"{self.url} has no entry {name!r}: {hint}")

    # -- reading ------------------------------------------------------------------------------------------------------

    def read_tensor(self, name: str | Entry, region: Region | None = None) -> torch.Tensor:
        """The tensor (or ``tensor[region]``, basic slicing with step 1) as a new CPU tensor.

        Only the chunks (inner chunks, for large arrays) that intersect the region are fetched.
        """
        from dcp_zarr.format.torch_arrays import numpy_as_tensor

        entry = self.entry(name)
        array = self.read_array(entry, region)  # refuses an entry that is not a tensor
        dtype = entry.dtype
        assert dtype is not None  # every tensor entry records its dtype
        return numpy_as_tensor(array, dtype)  # shares the array's memory: no copy

    def read_array(self, name: str | Entry, region: Region | None = None) -> np.ndarray:
        """As ``read_tensor``, as a new numpy array and without torch: bfloat16 and float8 come as ml_dtypes' types
        (``Entry.numpy_dtype``), bit-exact."""
        entry = self.entry(name)
        if entry.kind != TENSOR:
            raise TypeError(f"{self.url}: entry {entry.fqn!r} is a {entry.kind}, not a tensor; use read_value")
        assert entry.shape is not None  # every tensor entry records its shape
        offsets, sizes, squeeze = region_box(entry.shape, region, entry.fqn)
        out = np.empty(sizes, dtype=entry.numpy_dtype)
        if out.size:  # a region without elements touches no chunk, nor the array's zarr.json (0-d arrays have one)
            self._read_box(entry, offsets, out)
        return out.reshape([n for n, drop in zip(sizes, squeeze) if not drop]) if any(squeeze) else out

    def read_value(self, name: str | Entry):
        """A non-tensor entry (hyperparameters, param_groups, scheduler state) as the Python value saved."""
        entry = self.entry(name)
        if entry.kind in (VALUE, OBJECT):
            return self._stored_value(entry)
        raise TypeError(f"{self.url}: entry {entry.fqn!r} is a tensor; use read_tensor")

    def read_object_bytes(self, name: str | Entry) -> bytes:
        """The ``torch.save`` bytes of an object entry, crc32c-checked and not decoded (no torch): what ``diff``
        compares where torch cannot be imported."""
        entry = self.entry(name)
        if entry.kind != OBJECT:
            raise TypeError(f"{self.url}: entry {entry.fqn!r} is a {entry.kind}, not torch.save bytes")
        stored = self.manifest.entries[entry.fqn]
        assert isinstance(stored, ObjectEntry)  # the entry's kind is the manifest entry's
        return stored_object_bytes(self.storage, stored, entry.fqn)

    def read(self, name: str | Entry):
        entry = self.entry(name)
        return self.read_tensor(entry) if entry.kind == TENSOR else self.read_value(entry)

    def load_full_state_dict(self, *, prefix: Sequence | None = None, progress: bool | None = False) -> dict:
        """Every entry (or those whose path starts with ``prefix``), unsharded, as the nested state dict saved.

        ``prefix=("model",)`` loads only the model weights. Needs memory for all of it, like ``torch.load``.
        """
        chosen = [e for e in self.entries.values() if prefix is None or tuple(e.path[: len(prefix)]) == tuple(prefix)]
        arrays = {e.fqn: _blank_array(e) for e in chosen if e.kind == TENSOR}
        self._open_readers([e for e in chosen if e.fqn in arrays and arrays[e.fqn].size])
        # Every tensor's row pieces and every value in one run, as ZarrReader reads: small reads batched, large ones
        # in pieces, within the storage's requests and bytes in flight.
        jobs: list[tuple[int, Callable]] = []
        value_jobs: dict[str, int] = {}
        for entry in chosen:
            out = arrays.get(entry.fqn)
            if out is None:
                value_jobs[entry.fqn] = len(jobs)
                jobs.append((entry.nbytes, partial(self.read_value, entry)))
            elif out.size:  # a tensor without elements touches no chunk, nor its zarr.json
                jobs += self.region_reader(entry).read_jobs([0] * out.ndim, out)
        with progress_bar(sum(e.nbytes for e in chosen), "loading", enabled=progress) as bar:
            results = self._run(jobs if progress is False else _counted(jobs, bar.update))
        values = {fqn: results[at] for fqn, at in value_jobs.items()}
        if arrays:
            from dcp_zarr.format.torch_arrays import numpy_as_tensor

            for fqn, array in arrays.items():
                dtype = self.entries[fqn].dtype
                assert dtype is not None  # every tensor entry records its dtype
                values[fqn] = numpy_as_tensor(array, dtype)  # shares the array's memory: no copy
        state: dict = {}
        for entry in chosen:
            set_by_path(state, entry.path, values[entry.fqn])
        return state

    # -- helpers ------------------------------------------------------------------------------------------------------

    def region_reader(self, entry: Entry) -> RegionReader:
        reader = self._readers.get(entry.fqn)
        if reader is None:
            reader = self._readers[entry.fqn] = tensor_reader(self.storage, self.manifest.entries[entry.fqn], entry.fqn,
                                                              checked=self.manifest.checked_copies.get(entry.node))
        return reader

    def _open_readers(self, entries: list[Entry]) -> None:
        """The region readers of ``entries``; where an array's zarr.json must be read (a store without
        copies), read concurrently: one after another they would be a round trip per tensor on an object store."""
        missing = [e for e in entries if e.fqn not in self._readers]
        if any(e.node not in self.manifest.checked_copies for e in missing):
            self._run([(0, partial(self.region_reader, e)) for e in missing])

    def _read_box(self, entry: Entry, offsets: list[int], out: np.ndarray) -> None:
        self._run(self.region_reader(entry).read_jobs(offsets, out))

    def _run(self, jobs: Sequence[tuple[int, Callable]]) -> list:
        """Jobs on the scheduler ZarrReader uses, within the storage's requests and bytes in flight."""
        return run_storage_jobs(self.storage, jobs, self.thread_count, name="dcp-zarr-offline")

    def _stored_value(self, entry: Entry):
        return stored_value(self.storage, self.manifest.entries[entry.fqn], entry.fqn, self.safe_globals,
                            "open_checkpoint(..., safe_globals=[...])")


def open_checkpoint(path: str | os.PathLike | None = None, storage_options: dict | None = None, *,
                    store=None, thread_count: int = 8, safe_globals: list | None = None,
                    retry: RetryPolicy | None = None) -> Checkpoint:
    """Open a dcp_zarr checkpoint (a local directory, an fsspec URL, or a zarr store object as ``store=``) for
    reading; no process group needed. ``retry``: the ``RetryPolicy`` of its object-store calls."""
    location, store = store_objects.resolve("open_checkpoint", path, store, writable=False)
    if store is not None:
        storage = open_storage(store=store, retry=retry)
        return Checkpoint(storage, read_manifest(storage), thread_count=thread_count, safe_globals=safe_globals)
    if not location:
        raise ValueError("open_checkpoint needs a path or a store: pass path or store=")
    local = directory_of(location)
    if local is not None:
        if not os.path.exists(local):
            raise NotACheckpointError(f"{local} does not exist")
        refuse_a_file(local)
        if is_dcp_directory(local):
            raise NotACheckpointError(
                f"{local} is a torch.distributed.checkpoint directory (.metadata + .distcp files), not a zarr store; "
                f"convert it with: dcp-zarr convert {location} OUT.zarr --to zarr")
    storage = open_storage(location, storage_options, read_only=True, retry=retry)
    return Checkpoint(storage, read_manifest(storage), thread_count=thread_count, safe_globals=safe_globals)


def is_dcp_directory(path: str | os.PathLike) -> bool:
    """A local torch.distributed.checkpoint directory (``.metadata`` + ``.distcp`` files)? Only a directory is one:
    DCP's FileSystemReader, which dcp_dir.py reads them with, reads nothing else."""
    location = os.fspath(path)
    directory = directory_of(location)
    return directory is not None and holds_dcp_checkpoint(open_storage(directory, read_only=True))


def refuse_a_file(local: str) -> None:
    """One clear line for a checkpoint path that is a file (``model.pt``), where reading ``FILE/zarr.json`` would
    fail with "[Errno 20] Not a directory"."""
    if os.path.isfile(local):
        raise NotACheckpointError(f"{local} is a file, not a checkpoint directory (a zarr store or a DCP directory)")


def _blank_array(entry: Entry) -> np.ndarray:
    assert entry.shape is not None  # every tensor entry records its shape
    return np.empty(entry.shape, dtype=entry.numpy_dtype)


def _counted(jobs: Sequence[tuple[int, Callable]], update: Callable[[int], object]) -> list[tuple[int, Callable]]:
    """``jobs``, each calling ``update`` with its bytes once done (a progress bar's, from the threads in turn)."""
    lock = threading.Lock()

    def counted(nbytes: int, job: Callable):
        result = job()
        with lock:
            update(nbytes)
        return result

    return [(nbytes, partial(counted, nbytes, job)) for nbytes, job in jobs]


def set_by_path(root: dict, path: Sequence, value) -> None:
    """Place ``value`` at ``path`` in a nested state dict; int components index lists (as DCP's set_element)."""
    node: dict | list = root
    for key, next_key in zip(path[:-1], path[1:]):
        child = node[key] if _has(node, key) else None
        if child is None:
            child = [] if isinstance(next_key, int) else {}
            _put(node, key, child)
        node = child
    _put(node, path[-1], value)


def _has(container, key) -> bool:
    if isinstance(container, list):
        return isinstance(key, int) and key < len(container)
    return key in container


def _put(container, key, value) -> None:
    if isinstance(container, list):
        container.extend([None] * (key + 1 - len(container)))
    container[key] = value


def region_box(shape: tuple[int, ...], region: Region | None, fqn: str):
    """(offsets, sizes, dims to drop) of a basic-slicing region; refuses steps and out-of-range indices."""
    if region is None:
        return [0] * len(shape), list(shape), [False] * len(shape)
    if not isinstance(region, (tuple, list)):
        region = (region,)
    if sum(r is Ellipsis for r in region) > 1:
        raise IndexError(f"{fqn}: at most one ... in a region")
    if Ellipsis in region:
        at = list(region).index(Ellipsis)
        region = (*region[:at], *[slice(None)] * (len(shape) - len(region) + 1), *region[at + 1:])
    if len(region) > len(shape):
        raise IndexError(f"{fqn}: region {region!r} has {len(region)} indices for a {len(shape)}-d tensor")
    region = (*region, *[slice(None)] * (len(shape) - len(region)))
    offsets, sizes, squeeze = [], [], []
    for index, n in zip(region, shape):
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                raise IndexError(f"{fqn}: region slices must have step 1, got {index!r}")
            offsets.append(start)
            sizes.append(max(0, stop - start))
            squeeze.append(False)
        elif isinstance(index, int) or _is_torch_scalar(index):
            i = int(index)
            if not -n <= i < n:
                raise IndexError(f"{fqn}: index {i} is out of range for a dimension of size {n}")
            offsets.append(i % n)
            sizes.append(1)
            squeeze.append(True)
        else:
            raise IndexError(f"{fqn}: region entries must be slices or ints, got {index!r}")
    return offsets, sizes, squeeze


def _is_torch_scalar(index) -> bool:
    # A 0-d tensor index can only come from a program that has imported torch: never import it to ask.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(index, torch.Tensor) and index.dim() == 0
