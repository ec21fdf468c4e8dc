"""The root zarr.json's consolidated metadata as the writer encodes it (format/consolidated.py): copies encoded one
by one, then spliced into the root; the result is what encoding the whole document at once gives."""

from __future__ import annotations

import json

import pytest

from dcp_zarr.format.consolidated import KEY, encoded_copy, encoded_root
from dcp_zarr.json_documents import json_text

ROOT = {"zarr_format": 3, "node_type": "group", "attributes": {"dcp_zarr": {"entries": {"w": [1, 2]}}}}
ARRAY = {"zarr_format": 3, "node_type": "array", "shape": [4, 2], "attributes": {"dcp_zarr": {"fqn": "a.w"}}}
GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}
NO_CHILDREN = {"kind": "inline", "must_understand": False, "metadata": {}}


def test_the_root_keeps_its_fields_and_holds_every_copy_in_path_order():
    copies = {"b": encoded_copy(ARRAY), "a": encoded_copy(GROUP), "a/w": encoded_copy(ARRAY)}

    root = json.loads(encoded_root(ROOT, copies))

    assert {k: v for k, v in root.items() if k != KEY} == ROOT
    assert root[KEY]["kind"] == "inline" and root[KEY]["must_understand"] is False
    assert list(root[KEY]["metadata"]) == ["a", "a/w", "b"]
    assert root[KEY]["metadata"]["b"] == ARRAY


def test_a_groups_copy_says_it_has_no_consolidated_children_and_an_arrays_is_unchanged():
    assert json.loads(encoded_copy(GROUP)) == {**GROUP, KEY: NO_CHILDREN}
    assert json.loads(encoded_copy(ARRAY)) == ARRAY


def test_spliced_bytes_are_what_encoding_the_whole_document_gives():
    copies = {"a": encoded_copy(GROUP), "a/w": encoded_copy(ARRAY)}
    whole = {**ROOT, KEY: {"kind": "inline", "must_understand": False,
                           "metadata": {"a": {**GROUP, KEY: NO_CHILDREN}, "a/w": ARRAY}}}

    assert encoded_root(ROOT, copies) == json_text(whole).encode()


def test_no_copies_give_empty_consolidated_metadata():
    assert json.loads(encoded_root(ROOT, {}))[KEY] == NO_CHILDREN


@pytest.mark.parametrize("root", [{}, {**ROOT, KEY: NO_CHILDREN}], ids=["empty", "already consolidated"])
def test_a_root_that_cannot_take_the_field_is_refused(root):
    with pytest.raises(ValueError, match=KEY):
        encoded_root(root, {})


def test_a_value_json_cannot_hold_is_refused_as_json_dumps_refuses_it():
    with pytest.raises(ValueError):
        encoded_copy({**ARRAY, "fill_value": float("nan")})
