"""A copy of every node's ``zarr.json`` inside the root ``zarr.json``, so that a load reads one document.

``ZarrReader`` checks each array against its copy instead of fetching the array's own ``zarr.json``: one GET per
tensor per rank on an object store (a large share of a load's requests: benchmarks/reports/performance.md, "Many
entries, files and requests"), an open and read per tensor on a file system. Each node's own ``zarr.json`` is still
written, with the same content, and ``dcp-zarr verify`` checks that the two agree.

Where the copies are (docs/format.md#node-copies):

* Format 6 keeps them in the manifest, its ``nodes`` table (``{node path: document}``), which zarr tools read as an
  attribute and never parse. Formats 4 and 5 kept them as zarr's consolidated metadata, which zarr-python parses
  whole when it opens the group: one array of a data type it does not know (bfloat16, where dcp-zarr is not
  installed) then made every array of the checkpoint unreadable, where without it each array opens, or fails, on its
  own.
* Stores of formats 4 and 5 are read from their consolidated metadata; older ones have no copies (each array's own
  ``zarr.json`` is read).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping

from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.json_documents import decode_json, json_text

MANIFEST_ATTRIBUTE = "dcp_zarr"  # the root's attribute that holds the manifest (manifest.py)
NODES = "nodes"  # the manifest's field (format 6)
CONSOLIDATED = "consolidated_metadata"  # zarr's root field (formats 4 and 5)


def encoded_root(root: dict, manifest: dict, copies: dict[str, str]) -> bytes:
    """The root ``zarr.json`` ``root`` whose manifest (``manifest``, the dict inside ``root``'s attributes) gets the
    ``nodes`` table of ``copies`` (node path, relative to the root and without the root itself -> its ``zarr.json``
    as ``json_text`` encodes it), in path order, encoded as ``Storage.write_json`` would (``json_text``).

    The copies come encoded, each made and encoded in turn, because decoded they would all be alive at once: about
    twenty dicts and lists per array, thousands for a model, whose allocation sets off the garbage collector's full
    collections of the whole process, torch's objects included, in the coordinator's commit
    (benchmarks/reports/performance.md, "Many entries, files and requests": "Fewer objects per save"). They are
    spliced in where a placeholder, a random string that appears nowhere else in the document, was encoded."""
    if NODES in manifest or CONSOLIDATED in root:
        raise ValueError(f"the root document must hold a manifest without {NODES} and no {CONSOLIDATED}")
    placeholder = f"dcp_zarr nodes {uuid.uuid4().hex}"
    manifest[NODES] = placeholder
    try:
        text = json_text(root)
    finally:
        del manifest[NODES]
    quoted = json_text(placeholder)
    if text.count(quoted) != 1:  # the manifest is not inside root, or a value spells the placeholder (2**-122)
        raise ValueError("the manifest must be inside the root document, once")
    nodes = ",".join(f"{json_text(path)}:{copies[path]}" for path in sorted(copies))
    return text.replace(quoted, f"{{{nodes}}}").encode()


def copies_of(root: dict, where: str) -> dict[str, dict]:
    """Node path -> ``zarr.json`` document of every node whose copy the root holds (decoded): the manifest's
    ``nodes``, else zarr's consolidated metadata (formats 4 and 5), else none (formats 1 to 3: their arrays' own
    ``zarr.json`` is read). Each document is checked where it is used, as the node's own would be. ``where`` names
    the root document in errors."""
    attributes = root.get("attributes")
    manifest = attributes.get(MANIFEST_ATTRIBUTE) if isinstance(attributes, dict) else None
    if isinstance(manifest, dict) and NODES in manifest:
        nodes = manifest[NODES]
        if not isinstance(nodes, dict):
            raise MalformedMetadataError(f"{where}: the manifest's {NODES!r} is not a table of zarr.json documents")
        return _checked(nodes, f"{where}: the manifest's {NODES!r}")
    field = root.get(CONSOLIDATED)
    if field is None:
        return {}
    metadata = field.get("metadata") if isinstance(field, dict) else None
    if not isinstance(metadata, dict) or field.get("kind") != "inline":
        raise MalformedMetadataError(f"{where}: {CONSOLIDATED} is not inline consolidated metadata (a 'metadata' "
                                     "object)")
    return _checked(metadata, f"{where}: {CONSOLIDATED}")


def _checked(documents: dict, where: str) -> dict[str, dict]:
    for path, document in documents.items():
        if not isinstance(document, dict):
            raise MalformedMetadataError(f"{where} entry {path!r} is not a zarr.json document")
    return documents


# Keeps a copy as the text it was decoded from, whatever that held: a store's NaN or Infinity must come back out of
# the copy for the checks that refuse it by name (json_text, which refuses them, would raise a bare ValueError).
_KEPT_TEXT = json.JSONEncoder(separators=(",", ":"), allow_nan=True)


class NodeDocuments(Mapping[str, dict]):
    """The copies in a root's bytes: decoded when first looked up (the root once, each copy then kept as its JSON
    text), each a fresh dict when looked up.

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
