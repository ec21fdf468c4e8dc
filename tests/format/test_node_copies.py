"""The nodes' zarr.json copies in the root zarr.json (format/node_copies.py): encoded one by one, then spliced into the
manifest's ``nodes``; the result is what encoding the whole document at once gives. Stores of formats 4 and 5 keep
them as zarr's consolidated metadata, which is still read."""

from __future__ import annotations

import json

import pytest

from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.format.node_copies import CONSOLIDATED, NODES, copies_of, encoded_root
from dcp_zarr.json_documents import json_text

ARRAY = {"zarr_format": 3, "node_type": "array", "shape": [4, 2], "attributes": {"dcp_zarr": {"fqn": "a.w"}}}
GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def _root() -> tuple[dict, dict]:
    manifest = {"entries": {"w": [1, 2]}}
    return {"zarr_format": 3, "node_type": "group", "attributes": {"dcp_zarr": manifest, "step": 3}}, manifest


def test_the_manifest_holds_every_copy_in_path_order_and_the_root_keeps_its_fields():
    root, manifest = _root()
    copies = {"b": json_text(ARRAY), "a": json_text(GROUP), "a/w": json_text(ARRAY)}

    decoded = json.loads(encoded_root(root, manifest, copies))

    assert CONSOLIDATED not in decoded  # zarr-python parses that whole on opening: one unknown dtype fails them all
    assert list(decoded["attributes"]["dcp_zarr"][NODES]) == ["a", "a/w", "b"]
    assert decoded["attributes"]["dcp_zarr"][NODES]["b"] == ARRAY
    del decoded["attributes"]["dcp_zarr"][NODES]
    assert decoded == root and NODES not in manifest  # the document given is left as it was


def test_spliced_bytes_are_what_encoding_the_whole_document_gives():
    root, manifest = _root()
    whole, _ = _root()
    whole["attributes"]["dcp_zarr"][NODES] = {"a": GROUP, "a/w": ARRAY}

    assert encoded_root(root, manifest, {"a": json_text(GROUP), "a/w": json_text(ARRAY)}) == json_text(whole).encode()


def test_no_copies_give_an_empty_table():
    root, manifest = _root()
    assert json.loads(encoded_root(root, manifest, {}))["attributes"]["dcp_zarr"][NODES] == {}


def test_a_manifest_outside_the_root_or_a_root_with_copies_already_is_refused():
    root, manifest = _root()
    with pytest.raises(ValueError, match="inside the root"):
        encoded_root(root, dict(manifest), {})
    with pytest.raises(ValueError, match=NODES):
        encoded_root(root, {**manifest, NODES: {}}, {})
    with pytest.raises(ValueError, match=CONSOLIDATED):
        encoded_root({**root, CONSOLIDATED: {}}, manifest, {})


def test_copies_are_read_from_the_manifest_and_from_the_consolidated_metadata_of_formats_4_and_5():
    root, manifest = _root()
    ours = json.loads(encoded_root(root, manifest, {"a/w": json_text(ARRAY)}))
    older, _ = _root()
    older[CONSOLIDATED] = {"kind": "inline", "must_understand": False, "metadata": {"a/w": ARRAY}}

    assert copies_of(ours, "here") == copies_of(older, "here") == {"a/w": ARRAY}
    assert copies_of(_root()[0], "here") == {}  # formats 1 to 3: none


@pytest.mark.parametrize("nodes", [[], {"a/w": 3}], ids=["not a table", "not a document"])
def test_malformed_copies_are_refused_naming_the_field(nodes):
    root, manifest = _root()
    manifest[NODES] = nodes
    with pytest.raises(MalformedMetadataError, match=f"here: the manifest's '{NODES}'"):
        copies_of(root, "here")


def test_a_value_json_cannot_hold_is_refused_as_json_dumps_refuses_it():
    root, manifest = _root()
    manifest["bad"] = float("nan")
    with pytest.raises(ValueError):
        encoded_root(root, manifest, {})
