"""Consolidated metadata: a copy of every node's ``zarr.json`` inside the root ``zarr.json``, as
``zarr.consolidate_metadata`` writes it.

zarr-python and xarray then open every array of a checkpoint from one read, and ``ZarrReader`` checks each array
against its copy instead of fetching the array's own ``zarr.json``: one GET per tensor per rank on an object store
(a large share of a load's requests: benchmarks/reports/performance.md, "Many entries, files and requests"), an
open and read per tensor on a file system.
Each node's own ``zarr.json`` is still written, with the same content, for readers that do not know the extension
(TensorStore; zarr v3 itself does not specify it, so it is marked ``must_understand: false``); ``dcp-zarr verify``
checks that the two agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.json_documents import decode_json, json_text

KEY = "consolidated_metadata"
_EMPTY = {"kind": "inline", "must_understand": False, "metadata": {}}


def encoded_copy(document: dict) -> str:
    """The copy of a node's ``zarr.json`` ``document`` that consolidated metadata holds, encoded. A group's copy
    says it has no consolidated children of its own, as zarr's copies do: its children are listed in the root's,
    flattened."""
    return json_text({**document, KEY: _EMPTY} if document.get("node_type") == "group" else document)


def encoded_root(root: dict, copies: dict[str, str]) -> bytes:
    """The root ``zarr.json`` ``root`` with the consolidated metadata of ``copies`` (node path, relative to the root
    and without the root itself -> its ``encoded_copy``), in path order, encoded as ``Storage.write_json`` would
    (``json_text``).

    The copies come encoded, each made and encoded in turn, because decoded they would all be alive at once: about
    twenty dicts and lists per array, thousands for a model, whose allocation sets off the garbage collector's full
    collections of the whole process, each a walk over every object torch and the model hold, in the coordinator's
    commit (benchmarks/reports/performance.md, "Many entries, files and requests": "Fewer objects per save")."""
    if not root or KEY in root:
        raise ValueError(f"the root document must be a non-empty group document without {KEY}")
    head = json_text(root)[:-1]  # without its closing brace
    metadata = ",".join(f"{json_text(path)}:{copies[path]}" for path in sorted(copies))
    return f'{head},"{KEY}":{{"kind":"inline","must_understand":false,"metadata":{{{metadata}}}}}}}'.encode()


def copies_of(root: dict, where: str) -> dict[str, dict]:
    """Node path -> ``zarr.json`` document of every node the root's consolidated metadata holds (decoded); empty when
    it has none (stores saved by dcp_zarr versions that did not write it: their arrays' own ``zarr.json`` is read
    instead). Each document is checked where it is used, as the node's own would be. ``where`` names the root
    document in errors."""
    field = root.get(KEY)
    if field is None:
        return {}
    metadata = field.get("metadata") if isinstance(field, dict) else None
    if not isinstance(metadata, dict) or field.get("kind") != "inline":
        raise MalformedMetadataError(f"{where}: {KEY} is not inline consolidated metadata (a 'metadata' object)")
    for path, document in metadata.items():
        if not isinstance(document, dict):
            raise MalformedMetadataError(f"{where}: {KEY} entry {path!r} is not a zarr.json document")
    return metadata


# Keeps a copy as the text it was decoded from, whatever that held: a store's NaN or Infinity must come back out of
# the copy for the checks that refuse it by name (json_text, which refuses them, would raise a bare ValueError).
_KEPT_TEXT = json.JSONEncoder(separators=(",", ":"), allow_nan=True)


class NodeDocuments(Mapping[str, dict]):
    """The consolidated copies of a root's bytes: decoded when first looked up (the root once, each copy then kept
    as its JSON text), each a fresh dict when looked up.

    A load does not look them up: it uses their checks, made as the manifest is read (``Manifest.checked_copies``).
    Decoded and kept, they would be about twenty dicts and lists per array for as long as a load runs (thousands for
    a model), which the garbage collector promotes to its oldest generation and then scans in a full collection of
    the process, torch's objects included, in most loads of hundreds of tensors (what a full collection costs:
    benchmarks/reports/performance.md, "Many entries, files and requests")."""

    def __init__(self, paths: tuple[str, ...] = (), data: bytes = b"", where: str = ""):
        self._paths = frozenset(paths)
        self._data = data
        self._where = where
        self._texts: dict[str, str] | None = None

    def __getitem__(self, node: str) -> dict:
        if node not in self._paths:
            raise KeyError(node)
        if self._texts is None:
            copies = copies_of(decode_json(self._data), self._where)
            self._texts = {path: _KEPT_TEXT.encode(document) for path, document in copies.items()}
        return decode_json(self._texts[node])

    def __contains__(self, node) -> bool:
        return node in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._paths))

    def __len__(self) -> int:
        return len(self._paths)
