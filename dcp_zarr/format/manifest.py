"""The checkpoint's own description: typed, validated, and stored as plain JSON in the root group's ``dcp_zarr``
attribute, readable with zarr alone.

The root ``zarr.json`` is written last, after every chunk and every other ``zarr.json``: its presence with this
attribute is what makes a store a complete checkpoint. This module is the one place that defines the manifest and
checks it; everything else reads attributes of ``Manifest`` and its entries. The schema is docs/format.md.

Format 2 records each tensor's chunk grid, not the boxes the saving ranks held: the writer chooses the grid so that
every rank's box is a union of whole chunks (``layout.chunk_layout_for_boxes``), so the array at its global shape and
its grid already say where every element is. The manifest is O(tensors) whatever the saving world size. Format 1
listed every box (``saved_chunks``, ~36 bytes per rank per tensor); it is still read, and its boxes are checked and
then only counted.

Every check here is linear in the manifest's size: a hostile manifest costs at most that.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from dcp_zarr.errors import (
    IncompleteCheckpointError,
    InvalidKeyError,
    MalformedMetadataError,
    NotACheckpointError,
)
from dcp_zarr.format.array_checks import checked_layout
from dcp_zarr.format.chunk_layout import (
    CHUNK_KEY_SEPARATOR,
    LEGACY_CHUNK_KEY_SEPARATOR,
    ChunkLayout,
    check_node_name,
    chunk_key,
)
from dcp_zarr.format.codecs import Codec, codec_from_json
from dcp_zarr.format.dtype_table import STORED_DTYPES
from dcp_zarr.format.fill_values import checked_fill
from dcp_zarr.format.node_copies import MANIFEST_ATTRIBUTE, NodeDocuments, copies_of
from dcp_zarr.format.optimizer_tables import OptimizerTable
from dcp_zarr.format.values import decode_value
from dcp_zarr.gc_pause import collector_paused
from dcp_zarr.json_documents import decode_json
from dcp_zarr.version import __version__

FORMAT_NAME = "dcp_zarr"
# What every save writes (docs/format.md#format-versions). 7: one-element tensors in their array's fill_value, with
# no chunk (format/fill_values.py); 6: the nodes' zarr.json copies in the manifest's "nodes"
# (format/node_copies.py), not in zarr's consolidated metadata; 5: compressed arrays (format/compression.py); 4:
# BytesIO and numpy values as JSON (values.NEW_IN_FORMAT_4); 3: chunk keys with "." (c.0.1)
FORMAT_VERSION = 7
COMPRESSED_FORMAT_VERSION = 5  # the first format that may hold compressed arrays
FILL_FORMAT_VERSION = 7  # the first format that may keep a tensor in its array's fill_value
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
ROOT_KEY = "zarr.json"
# A root zarr.json larger than this is refused before it is parsed. A format-2 manifest takes ~400 bytes per entry
# (20,000 entries: ~8 MB); format 1 grew with ranks x tensors (8,192 ranks x 6,000 entries: ~1.8 GB would be refused).
MAX_MANIFEST_BYTES = 1 << 30
# A tensor whose bytes do not fit a signed 64-bit size is refused (torch could not allocate or index it).
_MAX_TENSOR_BYTES = (1 << 63) - 1

# Entry kinds
TENSOR = "tensor"
VALUE = "value"  # a JSON value, held inline in the manifest (see values.py)
OBJECT = "object"  # torch.save bytes in a uint8 array, loaded with weights_only=True


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor, stored as one zarr array at its global shape."""

    fqn: str
    path: tuple[str | int, ...]
    node: str
    dtype: str  # torch's name, "torch.bfloat16"
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...] | None  # None only in early format-1 stores: the array's zarr.json has it
    inner_chunk_rows: int = 0
    requires_grad: bool = False
    saved_shards: int = 1  # non-empty boxes the saving ranks held (what `inspect` reports)
    source: dict = field(default_factory=dict)  # {"type": "dtensor", "placements": [...], ...} (sources.py)
    codec: Codec | None = None  # its chunks' compression (format 5), or None: stored as they are
    # its one element, held in its array's fill_value with no chunk stored (format 7: fill_values.py), or None
    fill: bool | int | float | None = None
    kind: ClassVar[str] = TENSOR

    def to_json(self) -> dict:
        document = {"path": list(self.path), "kind": TENSOR, "node": self.node, "dtype": self.dtype,
                    "shape": list(self.shape), "chunk_shape": list(self.chunk_shape or self.shape),
                    "inner_chunk_rows": self.inner_chunk_rows, "requires_grad": self.requires_grad,
                    "saved_shards": self.saved_shards, "source": self.source}
        if self.codec is not None:
            document["codec"] = self.codec.to_json()
        if self.fill is not None:
            document["fill"] = self.fill
        return document


@dataclass(frozen=True, slots=True)
class ValueEntry:
    """A non-tensor value held in the manifest as tagged JSON (values.py)."""

    fqn: str
    path: tuple[str | int, ...]
    node: str
    value: object  # the tagged JSON document; ``decode_value`` gives the Python value
    kind: ClassVar[str] = VALUE

    def to_json(self) -> dict:
        return {"path": list(self.path), "kind": VALUE, "node": self.node, "value": self.value}


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """A non-tensor value stored as ``torch.save`` bytes in a uint8 array."""

    fqn: str
    path: tuple[str | int, ...]
    node: str
    nbytes: int
    # of its one chunk's key; "/" in format 1 and 2 (not written: the version says)
    separator: str = CHUNK_KEY_SEPARATOR
    kind: ClassVar[str] = OBJECT

    @property
    def chunk(self) -> str:
        """The key of the chunk holding the bytes, below the node."""
        return chunk_key((0,), self.separator)

    def to_json(self) -> dict:
        return {"path": list(self.path), "kind": OBJECT, "node": self.node, "nbytes": self.nbytes}


Entry = TensorEntry | ValueEntry | ObjectEntry


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds and how it was saved."""

    entries: dict[str, Entry]  # in the saved state dict's order
    save_id: str | None = None
    versions: dict = field(default_factory=dict)
    saved_world_size: int = 1
    state_dict_type: str = "unknown"
    meshes: list = field(default_factory=list)
    optimizers: tuple[OptimizerTable, ...] | None = None  # None: a store written before tables were recorded
    format_version: int = FORMAT_VERSION
    # the manifest's "chunks": the chunk record of a save that records its chunks (format/chunk_record.py), as JSON,
    # checked by the next incremental save that reads it; nothing reads it to load
    chunk_record: dict | None = field(default=None, repr=False, compare=False)
    # node -> its zarr.json copied into the root (node_copies.py): the manifest's "nodes", which encoded_root adds
    # and to_json leaves out, or zarr's consolidated metadata (formats 4, 5); empty for stores saved without either
    node_documents: NodeDocuments = field(default_factory=NodeDocuments, repr=False, compare=False)
    # node -> the check of its copy in the root against its entry (format/array_checks.py), made
    # as the manifest is read: the layout, or why the copy is refused (raised when the entry is read)
    checked_copies: dict[str, ChunkLayout | str] = field(default_factory=dict, repr=False, compare=False)

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "complete": True,
            "save_id": self.save_id,
            "versions": self.versions,
            "saved_world_size": self.saved_world_size,
            "state_dict_type": self.state_dict_type,
            "meshes": self.meshes,
            "entries": {fqn: entry.to_json() for fqn, entry in self.entries.items()},
            "optimizers": None if self.optimizers is None else [t.to_json() for t in self.optimizers],
            **({} if self.chunk_record is None else {"chunks": self.chunk_record}),
        }

    @classmethod
    def from_json(cls, document, url: str) -> Manifest:
        """The manifest of ``document`` (the ``dcp_zarr`` attribute of format 1 or 2), or MalformedMetadataError."""
        if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
            raise MalformedMetadataError(f"{url}: the '{MANIFEST_ATTRIBUTE}' attribute is not a dcp_zarr manifest")
        version = document.get("format_version")
        if version not in READABLE_VERSIONS or type(version) is not int:
            raise MalformedMetadataError(_unreadable_version(version, url))
        if document.get("complete") is not True:
            raise IncompleteCheckpointError(f"{url}: the manifest is not marked complete")
        raw_entries = document.get("entries")
        if not isinstance(raw_entries, dict):
            raise MalformedMetadataError(f"{url}: the manifest has no 'entries' table")
        entries = {fqn: _entry_from_json(fqn, raw, version, url) for fqn, raw in raw_entries.items()}
        _check_paths_form_one_tree(entries, url)
        try:
            header = _header_from_json(document)
        except (TypeError, ValueError) as exc:
            raise MalformedMetadataError(f"{url}: manifest {exc}") from None
        optimizers = document.get("optimizers")
        if optimizers is not None:
            if not isinstance(optimizers, list):
                raise MalformedMetadataError(f"{url}: manifest 'optimizers' is {type(optimizers).__name__}, not a list")
            try:
                optimizers = tuple(OptimizerTable.from_json(table) for table in optimizers)
            except MalformedMetadataError as exc:
                raise MalformedMetadataError(f"{url}: {exc}") from None
        chunk_record = document.get("chunks")
        return cls(entries=entries, optimizers=optimizers, format_version=version,
                   chunk_record=chunk_record if isinstance(chunk_record, dict) else None, **header)


def _unreadable_version(version, url: str) -> str:
    readable = ", ".join(map(str, READABLE_VERSIONS))
    if type(version) is int and version > FORMAT_VERSION:
        return (f"{url}: dcp_zarr format version {version} is newer than this dcp_zarr {__version__} reads (versions "
                f"{readable}); a newer dcp-zarr wrote it: upgrade this one (pip install -U dcp-zarr, or a newer "
                "clone) to load it")
    return f"{url}: dcp_zarr format version {version!r}; this dcp_zarr reads versions {readable}"


def _check_paths_form_one_tree(entries: dict[str, Entry], url: str) -> None:
    """Every entry's state-dict path must have a place of its own in one nested state dict: no path inside another
    entry's value, no container indexed by both names and list positions, no negative or absurd list position (a
    hostile index of 10**12 would otherwise allocate a list that long when the state dict is rebuilt)."""
    leaves: set[tuple] = set()
    inner: dict[tuple, type] = {}  # a container's path -> the type of its keys (int: a list)
    # Items that are empty containers have no entry, so a list may be longer than the entries in it: the bound is
    # only against absurd lengths (a list of 2**24 Nones is 128 MiB).
    positions = max(len(entries), 1 << 24)
    for fqn, entry in entries.items():
        path = entry.path
        for depth, part in enumerate(path):
            if type(part) is int and not 0 <= part < positions:
                raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has list position {part} in its path "
                                             f"{list(path)}, outside 0..{positions - 1}")
            prefix = path[:depth]
            if prefix in leaves:
                raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has path {list(path)} inside another "
                                             f"entry's value {list(prefix)}")
            if inner.setdefault(prefix, type(part)) is not type(part):
                raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has path {list(path)}: {list(prefix)} "
                                             "is indexed both by names and by list positions")
        if path in leaves or path in inner:
            raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has path {list(path)}, which another entry "
                                         "also uses")
        leaves.add(path)


def _header_from_json(document: dict) -> dict:
    save_id = document.get("save_id")
    versions = document.get("versions", {})
    world = document.get("saved_world_size", 1)
    kind = document.get("state_dict_type", "unknown")
    meshes = document.get("meshes", [])
    if save_id is not None and not isinstance(save_id, str):
        raise ValueError(f"save_id {save_id!r} is not a string")
    if not isinstance(versions, dict):
        raise ValueError(f"versions {versions!r} is not a table")
    if type(world) is not int or world < 1:
        raise ValueError(f"saved_world_size {world!r} is not a positive integer")
    if not isinstance(kind, str):
        raise ValueError(f"state_dict_type {kind!r} is not a string")
    if not isinstance(meshes, list):
        raise ValueError(f"meshes {meshes!r} is not a list")
    return {"save_id": save_id, "versions": versions, "saved_world_size": world, "state_dict_type": kind,
            "meshes": meshes}


def _entry_from_json(fqn: str, raw, version: int, url: str) -> Entry:
    if not isinstance(raw, dict) or raw.get("kind") not in (TENSOR, VALUE, OBJECT):
        raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has no valid 'kind'")
    path, node = _location(fqn, raw, url)
    try:
        if raw["kind"] == TENSOR:
            return _tensor_from_json(fqn, path, node, raw, version)
        if raw["kind"] == VALUE:
            value = raw["value"]
            decode_value(value)  # a malformed value is refused with the manifest, not when (or wherever) it is loaded
            return ValueEntry(fqn, path, node, value)
        nbytes = raw["nbytes"]
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes {nbytes!r} is not a non-negative integer")
        return ObjectEntry(fqn, path, node, nbytes, LEGACY_CHUNK_KEY_SEPARATOR if version < 3 else CHUNK_KEY_SEPARATOR)
    except MalformedMetadataError:
        raise
    except KeyError as exc:
        raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} is malformed: it has no {exc}") from None
    except Exception as exc:  # any malformation of this entry (RecursionError included), reported naming it
        raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} is malformed: {exc}") from None


def _location(fqn: str, raw: dict, url: str) -> tuple[tuple, str]:
    """The entry's state-dict path, and its node, which must be a place inside this store: a hostile manifest must
    not send the reader to ``../other.zarr`` or ``/etc``."""
    path = raw.get("path", [fqn])
    if not isinstance(path, list) or not path or any(type(part) not in (str, int) for part in path):
        raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has a malformed path {path!r}")
    node = raw.get("node")
    if not isinstance(node, str):
        raise MalformedMetadataError(f"{url}: manifest entry {fqn!r} has no valid node ({node!r})")
    try:
        for name in node.split("/"):
            check_node_name(name, fqn)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"{url}: manifest entry {fqn!r} is stored at node {node!r}, which is refused: {exc}") \
            from None
    return tuple(path), node


def _tensor_from_json(fqn: str, path: tuple, node: str, raw: dict, version: int) -> TensorEntry:
    shape = _index_list(raw["shape"], "shape")
    itemsize = stored_numpy_dtype(raw["dtype"]).itemsize
    if math.prod(shape) * itemsize > _MAX_TENSOR_BYTES:
        raise ValueError(f"shape {list(shape)} of {raw['dtype']} is larger than any tensor can be")
    chunk_shape = raw.get("chunk_shape") if version == 1 else raw["chunk_shape"]
    if chunk_shape is not None:
        chunk_shape = _index_list(chunk_shape, "chunk_shape")
        if len(chunk_shape) != len(shape) or not all(chunk_shape):
            raise ValueError(
                f"chunk_shape {list(chunk_shape)} is not a grid of positive lengths for shape {list(shape)}")
    inner_rows = raw.get("inner_chunk_rows", 0)
    if type(inner_rows) is not int or inner_rows < 0:
        raise ValueError(f"inner_chunk_rows {inner_rows!r} is not a non-negative integer")
    requires_grad = raw.get("requires_grad", False)
    if type(requires_grad) is not bool:
        raise ValueError(f"requires_grad {requires_grad!r} is not a boolean")
    source = raw.get("source", {})
    if not isinstance(source, dict):
        raise ValueError(f"source {source!r} is not a table")
    if version == 1:
        saved_shards = _count_format1_boxes(raw["saved_chunks"], shape)
    else:
        saved_shards = raw.get("saved_shards", 1)
        if type(saved_shards) is not int or saved_shards < 0:
            raise ValueError(f"saved_shards {saved_shards!r} is not a non-negative integer")
    codec = raw.get("codec")
    if codec is not None:
        if version < COMPRESSED_FORMAT_VERSION:
            raise ValueError(f"codec {codec!r} in a format-{version} store, which holds no compressed arrays")
        try:
            codec = codec_from_json(codec, "codec")
        except MalformedMetadataError as exc:
            raise ValueError(str(exc)) from None
    fill = raw.get("fill")
    if fill is not None:
        if version < FILL_FORMAT_VERSION:
            raise ValueError(f"fill {fill!r} in a format-{version} store, which keeps no tensor in a fill value")
        fill = checked_fill(fill, STORED_DTYPES[raw["dtype"]][1], shape)
    return TensorEntry(fqn, path, node, raw["dtype"], shape, chunk_shape, inner_rows, requires_grad, saved_shards,
                       source, codec, fill)


def stored_numpy_dtype(name) -> np.dtype:
    """The numpy dtype a tensor entry's data is stored as, from its torch dtype name ("torch.bfloat16"), without
    importing torch; ValueError for a name dcp_zarr does not store."""
    if not isinstance(name, str) or name not in STORED_DTYPES:
        raise ValueError(f"torch dtype {name!r} is not one this dcp_zarr {__version__} stores; if a newer dcp-zarr "
                         "saved it, upgrade this one (pip install -U dcp-zarr) to read it")
    return STORED_DTYPES[name][0]


def _count_format1_boxes(boxes, shape: tuple[int, ...]) -> int:
    """The non-empty boxes of a format-1 entry, each checked to lie inside ``shape``, and their volumes to add up to
    the tensor's. Loads read the global array, not the boxes, so a consistency check (linear) is enough: a proof of
    exact coverage would need an overlap test quadratic in the boxes, and every check here stays linear."""
    if not isinstance(boxes, list):
        raise ValueError("saved_chunks is not a list")
    volume, count = 0, 0
    for box in boxes:
        offsets = _index_list(box["offsets"], "saved chunk offsets")
        sizes = _index_list(box["sizes"], "saved chunk sizes")
        if not len(offsets) == len(sizes) == len(shape):
            raise ValueError(f"saved chunk {list(offsets)}+{list(sizes)} is not a box of a rank-{len(shape)} tensor")
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise ValueError(f"saved chunk {list(offsets)}+{list(sizes)} lies outside shape {list(shape)}")
        box_volume = math.prod(sizes)
        volume += box_volume
        count += box_volume > 0
    if volume != math.prod(shape):
        raise ValueError(f"its saved chunks hold {volume} elements, but shape {list(shape)} has {math.prod(shape)}")
    return count


def _index_list(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(n) is int and n >= 0 for n in value):
        raise ValueError(f"{what} {value!r} is not a list of non-negative integers")
    return tuple(value)


def manifest_of_root(data: bytes, url: str) -> Manifest:
    """The manifest in the bytes of a root ``zarr.json`` read from ``url``, or an error saying what they are."""
    # The root document's thousands of containers are freed once the manifest is made from them: collected while
    # alive, they would be promoted to the oldest generation and set off a full collection (json_documents.decode_json).
    with collector_paused():
        return _manifest_of_root(data, url)


def _manifest_of_root(data: bytes, url: str) -> Manifest:
    try:
        root = decode_json(data)
    except (ValueError, RecursionError) as exc:
        raise MalformedMetadataError(f"{url}: root zarr.json is not valid JSON ({exc})") from None
    if not isinstance(root, dict) or root.get("zarr_format") != 3:
        raise NotACheckpointError(f"{url} is not a zarr v3 store (root zarr.json has no zarr_format 3)")
    document = root.get("attributes", {}).get(MANIFEST_ATTRIBUTE) if isinstance(root.get("attributes"), dict) else None
    if document is None:
        raise NotACheckpointError(
            f"{url} is a zarr store but not a dcp_zarr checkpoint "
            f"(no '{MANIFEST_ATTRIBUTE}' attribute at its root)"
        )
    where = f"{url}/{ROOT_KEY}"
    manifest = Manifest.from_json(document, where)
    copies = copies_of(root, where)
    checked: dict[str, ChunkLayout | str] = {}
    for fqn, entry in manifest.entries.items():
        copy = copies.get(entry.node) if isinstance(entry, TensorEntry) else None
        if copy is not None:
            assert isinstance(entry, TensorEntry)
            try:
                checked[entry.node] = checked_layout(copy, f"{url}: array {entry.node!r}", fqn, entry.shape,
                                                     entry.chunk_shape, entry.inner_chunk_rows, entry.dtype,
                                                     entry.codec, entry.fill)
            except MalformedMetadataError as exc:
                checked[entry.node] = str(exc)
    return dataclasses.replace(manifest, node_documents=NodeDocuments(tuple(copies), data, where),
                               checked_copies=checked)
