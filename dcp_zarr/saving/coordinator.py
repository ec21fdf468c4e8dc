"""The coordinator's two moments of a save, whichever way it was planned: before anything is written (``begin``: the
save's id and its staging area), and after every rank wrote (``finish``: the replicas' checksums compared, the
manifest's entries, every group's zarr.json, the root's, then the commit). Both kinds of save (``save.py``) end here,
so what a manifest entry records and when a save is abandoned are written once."""

from __future__ import annotations

import dataclasses
import uuid
from functools import partial
from typing import NamedTuple

from dcp_zarr.errors import ReplicaMismatchError
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.chunk_layout import parent_groups
from dcp_zarr.format.encoding import group_metadata
from dcp_zarr.format.group_attributes import group_attributes
from dcp_zarr.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_ATTRIBUTE,
    ROOT_KEY,
    Entry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    ValueEntry,
)
from dcp_zarr.format.node_copies import encoded_root
from dcp_zarr.format.optimizer_tables import tables_from_entries
from dcp_zarr.format.sources import summarize_sources
from dcp_zarr.json_documents import json_text
from dcp_zarr.planning import replicas
from dcp_zarr.saving.settings import SaveSettings
from dcp_zarr.storage import Storage
from dcp_zarr.store_io import commit
from dcp_zarr.store_io.scheduler import run_jobs
from dcp_zarr.store_io.write_jobs import array_metadata_text, object_array_metadata
from dcp_zarr.version import versions


class Begun(NamedTuple):
    save_id: str
    staging_location: str
    storage: Storage  # the staging area, prepared
    world_size: int


def begin(settings: SaveSettings, world_size: int) -> Begun:
    """The coordinator's choices before anything is written: the save's id and its staging area, prepared."""
    save_id = uuid.uuid4().hex[:12]
    location = settings.staging_location(save_id)
    storage = settings.open(location)
    commit.prepare_staging(storage)
    return Begun(save_id, location, storage, world_size)


def refuse_differing_replicas(begun: Begun, checksums: list[dict], differing_groups: frozenset[str] = frozenset()
                              ) -> None:
    """Raises ``ReplicaMismatchError`` naming the keys whose reported checksums differ between ranks (or, as a
    backstop, the replica groups whose digests differed), the staging area abandoned: nothing is committed."""
    try:
        replicas.compare_checksums(checksums)
        if differing_groups:  # nothing was written; compare_checksums names the keys, this is the backstop
            raise ReplicaMismatchError(f"replicated entries differ between the ranks of {sorted(differing_groups)}"
                                       "; nothing was committed")
    except ReplicaMismatchError:
        commit.abandon(begun.storage)
        raise


def tensor_entry(spec: ArraySpec, path: tuple, shape: tuple, requires_grad: bool, saved_shards: int,
                 source: dict | None, fill=None) -> TensorEntry:
    """The manifest entry of a tensor: its array's grid, not the saved boxes (every box is whole chunks of it);
    ``fill``: its one element, kept in its array's fill_value by the rank that wrote it (format/fill_values.py)."""
    layout = spec.layout
    return TensorEntry(fqn=spec.fqn, path=path, node=spec.node, dtype=spec.dtype_name, shape=shape,
                       chunk_shape=layout.chunk_shape, inner_chunk_rows=layout.inner_rows, requires_grad=requires_grad,
                       saved_shards=saved_shards, source=source or {"type": "unknown"}, codec=layout.codec, fill=fill)


def stored_value_entry(fqn: str, path: tuple, node: str, values: dict, objects: dict) -> Entry:
    """The manifest entry of a non-tensor value: its JSON document, else the size of its torch.save bytes."""
    if fqn in values:
        return ValueEntry(fqn, path, node, values[fqn])
    return ObjectEntry(fqn, path, node, objects[fqn])


def commit_save(settings: SaveSettings, begun: Begun, entries: dict[str, Entry], key_order: list,
                specs: dict[str, ArraySpec], chunk_record: dict | None = None) -> None:
    """Every group's zarr.json, then the root's (the manifest, every node's zarr.json copied), then the commit.
    ``chunk_record``: the manifest's ``chunks``, in a save that records its chunks (saving/incremental.py).
    A group's values are its attributes too, for zarr tools (format/group_attributes.py). The arrays' zarr.json
    files were written by the ranks (RankAssignment.describes); ``specs`` makes their copies."""
    storage = begun.storage
    attributes = group_attributes(entries, key_order)
    groups = {group: group_metadata(attributes.get(group))
              for group in {g for entry in entries.values() for g in parent_groups(entry.node)}}
    run_jobs([(0, partial(storage.write_json, f"{group}/zarr.json", doc)) for group, doc in groups.items()],
             storage.requests_in_flight(settings.thread_count), storage.batch_bytes)
    manifest = dataclasses.replace(_manifest(entries, key_order, begun), chunk_record=chunk_record)
    copies = {group: json_text(document) for group, document in groups.items()}
    copies.update(_array_copies(entries, specs))
    manifest_document = manifest.to_json()
    root = group_metadata({MANIFEST_ATTRIBUTE: manifest_document, **attributes.get("", {})})
    storage.write(ROOT_KEY, [encoded_root(root, manifest_document, copies)])
    commit.commit(storage, settings.path, replace=settings.replaces())


def _array_copies(entries: dict[str, Entry], specs: dict[str, ArraySpec]) -> dict[str, str]:
    """Node -> encoded zarr.json of every array, as the ranks wrote them, for the manifest's copies."""
    copies = {}
    for fqn, entry in entries.items():
        if isinstance(entry, TensorEntry):
            copies[entry.node] = array_metadata_text(specs[fqn], entry.fill)  # an array's copy is its zarr.json
        elif isinstance(entry, ObjectEntry):
            copies[entry.node] = json_text(object_array_metadata(fqn, entry.node, entry.nbytes))
    return copies


def _manifest(entries: dict[str, Entry], key_order: list, begun: Begun) -> Manifest:
    # key_order: the saved state dict's own key order (DCP's planner_data), which numbers the params of a
    # flattened optimizer state dict; entries come in plan order, which deduplication reshuffles.
    summary = summarize_sources([e.source for e in entries.values() if isinstance(e, TensorEntry)])
    # Anything in a table that JSON cannot hold fails at save: encoded_root dumps the whole manifest before the
    # commit.
    tables = tables_from_entries(entries, key_order)
    return Manifest(entries=entries, save_id=begun.save_id, versions=versions(), saved_world_size=begun.world_size,
                    state_dict_type=summary["state_dict_type"], meshes=summary["meshes"], optimizers=tuple(tables),
                    format_version=FORMAT_VERSION)
