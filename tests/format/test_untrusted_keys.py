"""Keys that could escape the store or collide are refused: at save (state-dict keys, before anything is written) and
at load (node paths in a manifest someone else wrote, before any file is opened)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcp_zarr import InvalidKeyError, MalformedMetadataError, ZarrReader
from dcp_zarr.planning.assignments import node_paths
from dcp_zarr.storage import LocalStorage
from tests.support.compare import assert_state_equal
from tests.support.faults import causes
from tests.support.states import blank_like, load_full, save_plain

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

BAD_NAMES = {
    "parent": "..",
    "current": ".",
    "empty": "",
    "slash": "a/b",
    "absolute": "/etc/passwd",
    "backslash": "a\\b",
    "windows path": "C:\\Windows",
    "NUL": "nul\x00byte",
    "newline": "line\nbreak",
    "escape character": "\x1b[31m",
    "DEL": "del\x7f",
    "reserved prefix": "__x",
    "zarr metadata name": "zarr.json",
    "zarr metadata name, other case": "ZARR.JSON",
    "longer than a file name may be": "w" * 256,
    "long in UTF-8 bytes": "é" * 128,
}
# Where the bad name sits: a tensor's key, a nested dict key, a non-tensor (JSON) value's key, an object's key.
PLACES = {
    "tensor": lambda name: {name: torch.ones(2)},
    "nested": lambda name: {"model": {"layers": {name: {"weight": torch.ones(2)}}}},
    "value": lambda name: {"model": {"w": torch.ones(2)}, "extra": {name: 3}},
    "object": lambda name: {"model": {"w": torch.ones(2)}, "extra": {name: {1, 2}}},
}


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("name", list(BAD_NAMES.values()), ids=list(BAD_NAMES))
def test_a_bad_key_is_refused_at_save_before_anything_is_written(tmp_path, name, place):
    path = tmp_path / "ckpt.zarr"
    with pytest.raises(CheckpointException) as info:
        save_plain(PLACES[place](name), str(path))
    cause = causes(info.value)[0]
    assert isinstance(cause, InvalidKeyError), repr(cause)
    assert repr(name) in str(cause), "the error names the offending key"
    assert os.listdir(tmp_path) == [], "nothing was written, not even a staging directory"


@pytest.mark.parametrize("name", ["layers.0.attention.wq.weight", "ünïcødé-κλειδί", "a b", "-x", "c", "x" * 255,
                                  "_single_underscore", "zarr.json.bak", "$HOME", "%2e%2e"])
def test_unusual_but_safe_keys_round_trip_and_zarr_opens_them(tmp_path, name):
    path = str(tmp_path / "ckpt.zarr")
    state = {"model": {name: torch.arange(6.0).reshape(2, 3), "other": torch.ones(1)}}
    save_plain(state, path)
    assert_state_equal(load_full(path, state), state)
    assert os.listdir(tmp_path) == ["ckpt.zarr"]
    assert os.path.isdir(os.path.join(path, "model", name)), "one directory per key, inside the store"
    assert zarr.open_group(path, mode="r")["model"][name].shape == (2, 3)


def test_keys_that_collide_after_flattening_are_refused(tmp_path):
    """An int and a str key, or a list index and a dotted key, flatten to one name: refused, nothing written."""
    for state in ({"x": {0: torch.ones(1), "0": torch.zeros(1)}},
                  {"x": [torch.ones(1)], "x.0": torch.zeros(1)},
                  {"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)}):
        with pytest.raises(CheckpointException, match="duplicated flatten key|would both be stored"):
            save_plain(state, str(tmp_path / "ckpt.zarr"))
        assert os.listdir(tmp_path) == []


def _plan(items: dict[str, tuple]) -> SavePlan:
    """A one-rank save plan of non-tensor items at the given state-dict paths (as a custom planner may produce)."""
    return SavePlan(items=[WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in items],
                    planner_data=dict(items))


def test_two_paths_that_name_one_node_are_refused():
    with pytest.raises(InvalidKeyError, match="would both be stored at 'x/0'"):
        node_paths([_plan({"x.0": ("x", 0), "x.'0'": ("x", "0")})])


def test_an_entry_that_is_also_another_entrys_group_is_refused():
    with pytest.raises(InvalidKeyError, match="needs as a group"):
        node_paths([_plan({"a": ("a",), "a.b": ("a", "b")})])


def test_paths_from_different_ranks_are_checked_together():
    with pytest.raises(InvalidKeyError, match="would both be stored"):
        node_paths([_plan({"x.0": ("x", 0)}), _plan({"x.'0'": ("x", "0")})])


# -- load: the manifest is untrusted -----------------------------------------------------------------------------


@pytest.fixture
def victim_and_store(tmp_path):
    """A checkpoint, and beside it another one whose data a hostile manifest could try to point at."""
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "optim": {"seen": torch.Size([1, 2])}}
    other = {"model": {"w": torch.full((3, 4), 7.0)}, "optim": {"seen": torch.Size([9])}}
    save_plain(state, str(tmp_path / "store.zarr"))
    save_plain(other, str(tmp_path / "victim.zarr"))
    return str(tmp_path / "store.zarr"), state


def _point_entry(path: str, fqn: str, node) -> None:
    file = os.path.join(path, "zarr.json")
    with open(file) as f:
        document = json.load(f)
    document["attributes"]["dcp_zarr"]["entries"][fqn]["node"] = node
    with open(file, "w") as f:
        json.dump(document, f)


HOSTILE_NODES = {
    "sibling store": "../victim.zarr/model/w",
    "dot-dot inside": "model/../../victim.zarr/model/w",
    "absolute": "/etc",
    "absolute into the sibling": "{root}/victim.zarr/model/w",
    "backslashes": "..\\victim.zarr\\model\\w",
    "empty component": "model//w",
    "NUL": "model/w\x00",
    "reserved": "__dcp/w",
}


@pytest.mark.parametrize("fqn", ["model.w", "optim.seen"], ids=["tensor", "object"])
@pytest.mark.parametrize("node", list(HOSTILE_NODES.values()), ids=list(HOSTILE_NODES))
def test_a_manifest_node_outside_the_store_is_refused_before_any_read(victim_and_store, tmp_path, monkeypatch,
                                                                      fqn, node):
    path, state = victim_and_store
    node = node.format(root=str(tmp_path))
    _point_entry(path, fqn, node)
    opened = []
    real_open = os.open

    def watch(file, *args, **kwargs):
        opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", watch)
    with pytest.raises(InvalidKeyError) as info:
        ZarrReader(path).read_metadata()
    assert repr(fqn) in str(info.value) and repr(node) in str(info.value)
    with pytest.raises(CheckpointException, match="refused"):
        dcp.load(blank_like(state), storage_reader=ZarrReader(path))
    assert not [f for f in opened if "victim" in f or f.startswith("/etc")], f"opened outside the store: {opened}"


def test_a_malformed_path_in_the_manifest_is_refused(victim_and_store):
    path, _ = victim_and_store
    file = os.path.join(path, "zarr.json")
    with open(file) as f:
        document = json.load(f)
    document["attributes"]["dcp_zarr"]["entries"]["model.w"]["path"] = {"evil": True}
    with open(file, "w") as f:
        json.dump(document, f)
    with pytest.raises(MalformedMetadataError, match="'model.w' has a malformed path"):
        ZarrReader(path).read_metadata()


@pytest.mark.parametrize("key", ["../victim.zarr/model/w/zarr.json", "model/../../x", "/etc/passwd", "a//b", "./a"])
def test_the_local_backend_refuses_keys_that_leave_its_root(tmp_path, key):
    """Defence in depth below the manifest checks: no key reaches a path outside the store's directory."""
    storage = LocalStorage(str(tmp_path / "store.zarr"))
    for operation in (lambda: storage.read(key), lambda: storage.write(key, [b"x"]), lambda: storage.exists(key)):
        with pytest.raises(InvalidKeyError):
            operation()
    assert os.listdir(tmp_path) == []
