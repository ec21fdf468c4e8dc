"""torch's own DCP checkpoint directories (``.metadata`` + ``__{rank}_{n}.distcp``), read offline.

``DcpCheckpoint`` offers the reading half of ``checkpoint.Checkpoint`` (entries, ``read_tensor``, ``read_value``,
``load_full_state_dict``), so conversion and ``dcp-zarr diff`` treat both formats alike. Unlike a zarr store, a DCP
directory can only be read whole: the first read loads every entry (``FileSystemReader`` through
an empty state dict's planner, as torch's own ``dcp_to_torch_save`` does), which needs memory for all of it.

DCP directories are pickles: ``.metadata`` and every non-tensor value are unpickled on load, exactly as
``dcp.load`` would. Open only directories you trust.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_zarr.errors import IncompleteCheckpointError, NotACheckpointError
from dcp_zarr.format.manifest import TENSOR, VALUE
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.offline import (
    Entry,
    is_dcp_directory,
    refuse_a_file,
    region_box,
    set_by_path,
)
from dcp_zarr.storage import directory_of
from dcp_zarr.store_io.root_document import DCP_METADATA_FILE as METADATA_FILE
from dcp_zarr.torch_private import whole_state_dict_planner


class DcpCheckpoint:
    """A DCP directory, checked for completeness on open and loaded whole on first read."""

    def __init__(self, path: str | os.PathLike):
        location = os.fspath(path)
        self.path = directory_of(location) or location  # a URL is refused below, named
        self.url = self.path
        refuse_a_file(self.path)
        if not is_dcp_directory(self.path):
            raise NotACheckpointError(
                f"{self.path} is not a torch.distributed.checkpoint directory (no {METADATA_FILE})")
        try:
            self.metadata: Metadata = FileSystemReader(self.path).read_metadata()
        except Exception as exc:
            raise NotACheckpointError(f"{self.path}/{METADATA_FILE} cannot be read as DCP metadata ({exc})") from exc
        _check_data_files(self.path, self.metadata)
        planner_data = self.metadata.planner_data or {}
        self.entries: dict[str, Entry] = {}
        for fqn, md in self.metadata.state_dict_metadata.items():
            entry_path = tuple(planner_data.get(fqn, (fqn,)))
            node = "/".join(map(str, entry_path))
            if isinstance(md, TensorStorageMetadata):
                shape = tuple(md.size)
                itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
                self.entries[fqn] = Entry(
                    fqn=fqn, path=entry_path, kind=TENSOR, node=node, nbytes=itemsize * _numel(shape),
                    dtype_name=str(md.properties.dtype), shape=shape,
                    saved_shards=sum(1 for c in md.chunks if all(c.sizes)))
            else:
                self.entries[fqn] = Entry(fqn=fqn, path=entry_path, kind=VALUE, node=node, nbytes=0)
        self._state: dict | None = None
        self._flat: dict | None = None

    def __iter__(self):
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def entry(self, name: str | Entry) -> Entry:
        if isinstance(name, Entry):
            return name
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"{self.path} has no entry {name!r}") from None

    def read_tensor(self, name: str | Entry, region=None) -> torch.Tensor:
        entry = self.entry(name)
        tensor = self._values()[entry.fqn]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{self.path}: entry {entry.fqn!r} is not a tensor")
        if region is None:
            return tensor
        offsets, sizes, squeeze = region_box(tuple(tensor.shape), region, entry.fqn)
        part = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        return part.reshape([n for n, drop in zip(sizes, squeeze) if not drop])

    def read_array(self, name: str | Entry, region=None):
        """``read_tensor`` as a numpy view (what ``diff`` compares, as it does for zarr stores)."""
        return tensor_as_numpy(self.read_tensor(name, region))

    def read_value(self, name: str | Entry):
        return self._values()[self.entry(name).fqn]

    def read(self, name: str | Entry):
        return self._values()[self.entry(name).fqn]

    def load_full_state_dict(self, *, prefix: Sequence | None = None, progress: bool | None = False) -> dict:
        state: dict = {}
        for entry in self.entries.values():
            if prefix is None or tuple(entry.path[: len(prefix)]) == tuple(prefix):
                set_by_path(state, entry.path, self._values()[entry.fqn])
        return state

    def _values(self) -> dict:
        """fqn -> loaded value, loading the whole directory the first time."""
        if self._flat is None:
            planner = whole_state_dict_planner()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed.*")
                dcp.load({}, storage_reader=FileSystemReader(self.path), planner=planner, no_dist=True)
            # dcp.load hands the planner a copy of the dict passed in; the planner's copy is the one it filled.
            state = planner.original_state_dict
            self._flat = {fqn: _get_by_path(state, entry.path) for fqn, entry in self.entries.items()}
        return self._flat


def _check_data_files(root: str, metadata: Metadata) -> None:
    """Every ``.distcp`` file the metadata points into exists and is long enough; else name the missing ones."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in needed if not os.path.isfile(os.path.join(root, name)))
    short = sorted(name for name in needed if name not in missing
                   and os.path.getsize(os.path.join(root, name)) < needed[name])
    if missing or short:
        parts = []
        if missing:
            parts.append(f"missing data files {missing}")
        if short:
            parts.append(f"truncated data files {short}")
        raise IncompleteCheckpointError(
            f"{root} is an incomplete DCP checkpoint: {' and '.join(parts)} (its .metadata refers to "
            f"{len(needed)} .distcp files); copy them from where the checkpoint was saved")


def _get_by_path(state, path):
    node = state
    for key in path:
        node = node[key]
    return node


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
