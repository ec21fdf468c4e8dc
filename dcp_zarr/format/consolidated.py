"""Consolidated metadata: a copy of every node's ``zarr.json`` inside the root ``zarr.json``, as
``zarr.consolidate_metadata`` writes it.

zarr-python and xarray then open every array of a checkpoint from one read, and ``ZarrReader`` checks each array
against its copy instead of fetching the array's own ``zarr.json``: one GET per tensor per rank on an object store
(42% of a 2-rank load's requests, benchmarks/reports/performance.md), an open and read per tensor on a file system.
Each node's own ``zarr.json`` is still written, with the same content, for readers that do not know the extension
(TensorStore; zarr v3 itself does not specify it, so it is marked ``must_understand: false``); ``dcp-zarr verify``
checks that the two agree.
"""

from __future__ import annotations

from dcp_zarr.errors import MalformedMetadataError

KEY = "consolidated_metadata"
_EMPTY = {"kind": "inline", "must_understand": False, "metadata": {}}


def consolidated(documents: dict[str, dict]) -> dict:
    """The ``consolidated_metadata`` field of the root ``zarr.json`` holding ``documents`` (node path -> its
    ``zarr.json`` document, paths relative to the root, without the root itself). Every group's copy says it has
    no consolidated children of its own, as zarr's copies do: its children are listed here, flattened."""
    metadata = {path: {**document, KEY: _EMPTY} if document.get("node_type") == "group" else document
                for path, document in sorted(documents.items())}
    return {"kind": "inline", "must_understand": False, "metadata": metadata}


def node_documents(root: dict, where: str) -> dict[str, dict]:
    """Node path -> ``zarr.json`` document of every node the root's consolidated metadata holds; empty when it has
    none (stores saved before it was written: their arrays' own ``zarr.json`` is read instead). Each document is
    checked where it is used, as the node's own would be. ``where`` names the root document in errors."""
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
