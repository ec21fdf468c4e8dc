"""A save's non-tensor values as attributes of their groups (format/group_attributes.py): what zarr-python alone shows
of a checkpoint's hyperparameters and other values, exactly or not at all, while dcp_zarr keeps loading from the
manifest."""

from __future__ import annotations

import io
import json
import math
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_zarr import ZarrReader, ZarrWriter
from dcp_zarr.format.group_attributes import NotPlainJSONError, group_attributes, plain_json
from dcp_zarr.format.manifest import ObjectEntry, TensorEntry, ValueEntry
from dcp_zarr.format.values import encode_value
from dcp_zarr.offline import open_checkpoint
from tests.support.states import save_plain
from tests.support.stores import root_copies


def plain(value):
    """What zarr shows of a value plain JSON holds: tuples as lists."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def trained_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


# ---- zarr-python alone ---------------------------------------------------------------------------------------------

_READ_WITH_ZARR_ALONE = r"""
import json, sys
sys.modules["torch"] = None  # `import torch` raises: proves nothing here needs it
import zarr

group = zarr.open_group(sys.argv[1], mode="r")
print(json.dumps({"hyperparameters": dict(group["optim/param_groups/0"].attrs), "meta": dict(group["meta"].attrs),
                  "modules": sorted(m for m in sys.modules if m.startswith("dcp_zarr"))}))
"""


def test_zarr_python_alone_reads_the_hyperparameters_and_values_of_a_plain_adamw_save_exactly(tmp_path):
    model, optimizer = trained_adamw()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    path = tmp_path / "adamw.zarr"
    meta = {"epoch": 3, "name": "run-a", "lrs": [0.1, 0.01]}
    dcp.save({"model": model_sd, "optim": optim_sd, "meta": meta}, storage_writer=ZarrWriter(path))

    done = subprocess.run([sys.executable, "-c", _READ_WITH_ZARR_ALONE, str(path)], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path))

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["meta"] == meta and type(report["meta"]["epoch"]) is int
    (group,) = optim_sd["param_groups"]
    assert report["hyperparameters"] == plain(group)
    assert report["hyperparameters"]["betas"] == [0.9, 0.95] and report["hyperparameters"]["eps"] == 1e-6
    assert report["hyperparameters"]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert {type(v) for v in report["hyperparameters"].values()} >= {float, bool, type(None), list}
    # zarr loaded only the torch-free data-type module of dcp_zarr (through its entry points), nothing of the reader
    assert set(report["modules"]) <= {"dcp_zarr", "dcp_zarr.errors", "dcp_zarr.version", "dcp_zarr.format",
                                      "dcp_zarr.format.zarr_dtypes", "dcp_zarr.format.dtype_table"}


def test_an_int_keyed_optimizer_state_dict_shows_its_param_ids(tmp_path):
    _, optimizer = trained_adamw()
    save_plain({"optim": optimizer.state_dict()}, str(tmp_path / "int.zarr"))

    attrs = zarr.open_group(str(tmp_path / "int.zarr"), mode="r")["optim/param_groups/0"].attrs
    assert dict(attrs) == plain(optimizer.state_dict()["param_groups"][0])
    assert attrs["params"] == [0, 1, 2, 3]


def test_every_group_with_values_shows_them_and_the_root_keeps_its_manifest(tmp_path):
    state = {"model": {"w": torch.ones(3)}, "meta": {"epoch": 3, "name": "run-a", "lrs": [0.1, 0.01],
                                                     "inner": {"seen": 12}}, "step": 7}
    save_plain(state, str(tmp_path / "values.zarr"))

    group = zarr.open_group(str(tmp_path / "values.zarr"), mode="r")
    assert dict(group["meta"].attrs) == {"epoch": 3, "name": "run-a", "lrs": [0.1, 0.01]}
    assert dict(group["meta/inner"].attrs) == {"seen": 12}
    assert dict(group["model"].attrs) == {}
    assert sorted(group.attrs) == ["dcp_zarr", "step"] and group.attrs["step"] == 7


def test_attributes_are_in_the_groups_own_zarr_json_and_its_copy_in_the_root(tmp_path):
    save_plain({"meta": {"epoch": 3}}, str(tmp_path / "s.zarr"))

    own = json.loads((tmp_path / "s.zarr/meta/zarr.json").read_text())
    assert own == root_copies(tmp_path / "s.zarr")["meta"] and own["attributes"] == {"epoch": 3}
    assert dict(zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["meta"].attrs) == {"epoch": 3}


# ---- values plain JSON cannot hold exactly: described, the save and its load unchanged ------------------------------

ODD = {
    "nan": float("nan"), "inf": float("inf"), "minus_inf": float("-inf"),
    "raw": b"\x00\xff", "ids": {1, 2}, "frozen": frozenset({"a"}), "buffer": io.BytesIO(b"rng"),
    "numpy_scalar": np.float32(0.5), "numpy_array": np.arange(3),
    "int_keys": ({1: "a"},),  # a tuple is one value: its dict is not a group
    "nan_inside": [1.0, float("nan")],
    "with_tensor": (torch.ones(2), 1),  # not JSON at all: torch.save bytes, an array
}
EXACT = {"negative_zero": -0.0, "huge": 2**80, "text": "é\u2028\"", "none": None, "flag": True,
         "dunder_keys": ({"__x": 1},), "nested": ((1, 2), {"a": (3,)}, [None])}


def test_values_plain_json_cannot_hold_are_described_and_the_rest_are_exact(tmp_path):
    group = {"lr": torch.tensor(0.01), **ODD, **EXACT, "params": ["w"]}
    state = {"model": {"w": torch.ones(3)}, "optim": {"param_groups": [group]}}
    path = str(tmp_path / "odd.zarr")
    save_plain(state, path)

    saved = zarr.open_group(path, mode="r")["optim/param_groups/0"]
    described = saved.attrs["dcp_zarr"]["values"]
    assert {k: v for k, v in saved.attrs.items() if k != "dcp_zarr"} == {**plain(EXACT), "params": ["w"]}
    assert list(described) == [name for name in ODD if name != "with_tensor"]  # an array describes itself
    assert math.copysign(1.0, saved.attrs["negative_zero"]) == -1.0
    # a tensor is an array of the group, as any tensor; so is a value stored as torch.save bytes
    assert saved["lr"][...] == np.float32(0.01) and saved["with_tensor"].dtype == np.uint8


def test_a_save_with_odd_values_loads_them_exactly_from_the_manifest(tmp_path):
    path = str(tmp_path / "odd.zarr")
    save_plain({"meta": {**ODD, **EXACT}}, path)

    ckpt = open_checkpoint(path)
    for name, expected in {**ODD, **EXACT}.items():
        value = ckpt.read_value(f"meta.{name}")
        if name in ("nan", "nan_inside", "buffer", "numpy_array", "with_tensor"):
            continue  # equal in their own ways: tests/format/test_values.py and test_save_load.py
        assert type(value) is type(expected) and value == expected, name
    assert math.isnan(ckpt.read_value("meta.nan"))


def _read_as_described(path, group, name):
    """Follow a description's ``read`` expression with zarr, base64, io and numpy alone."""
    import base64

    root = zarr.open_group(path, mode="r")
    description = root[group].attrs["dcp_zarr"]["values"][name]
    return eval(description["read"], {"base64": base64, "io": io, "numpy": np, "manifest": root.attrs["dcp_zarr"]})


def test_each_described_value_says_its_kind_size_and_an_expression_that_reads_it(tmp_path):
    torch_saved = io.BytesIO()
    torch.save({"step": 7}, torch_saved)
    values = {"raw": b"\x00\xff\x01", "pickled": pickle.dumps({"position": 12}), "buffer": torch_saved,
              "nan": float("nan"), "array": np.arange(6, dtype="<i4").reshape(2, 3), "scalar": np.float32(0.5),
              "ids": {1, 2}, "int_keys": ({1: "a"},)}  # a tuple is one value (a dict would be a group)
    path = str(tmp_path / "described.zarr")
    save_plain({"meta": dict(values), "w": torch.ones(2)}, path)

    described = zarr.open_group(path, mode="r")["meta"].attrs["dcp_zarr"]["values"]
    assert {name: d["kind"] for name, d in described.items()} == {
        "raw": "bytes", "pickled": "bytes", "buffer": "io.BytesIO", "nan": "float", "array": "numpy.ndarray",
        "scalar": "numpy.float32", "ids": "set", "int_keys": "tuple"}
    assert all(d["entry"] == f"meta.{name}" for name, d in described.items())
    assert described["raw"]["nbytes"] == 3 and "content" not in described["raw"]
    assert described["pickled"]["content"].startswith(f"pickle protocol {pickle.DEFAULT_PROTOCOL}: pickle.loads")
    assert described["buffer"]["nbytes"] == len(torch_saved.getvalue())
    assert "torch.load(..., weights_only=True)" in described["buffer"]["content"]
    assert (described["array"]["dtype"], described["array"]["shape"], described["array"]["nbytes"]) == \
        ("<i4", [2, 3], 24)
    assert (described["nan"]["repr"], described["ids"]["len"], described["ids"]["repr"]) == ("nan", 2, "{1, 2}")
    for name in ("raw", "pickled", "nan", "array", "scalar"):  # the standard library and numpy read them
        value = _read_as_described(path, "meta", name)
        assert repr(value) == repr(values[name]) and type(value) is type(values[name]), name
    assert _read_as_described(path, "meta", "buffer").getvalue() == torch_saved.getvalue()
    assert "decode_value" in described["ids"]["read"]  # a set's items are tagged JSON: dcp_zarr's decoder reads them


def test_a_value_named_as_the_groups_own_attribute_is_described_with_its_value(tmp_path):
    path = str(tmp_path / "named.zarr")
    save_plain({"meta": {"dcp_zarr": 5, "epoch": 1}}, path)

    attrs = zarr.open_group(path, mode="r")["meta"].attrs
    assert attrs["epoch"] == 1 and attrs["dcp_zarr"]["values"]["dcp_zarr"]["repr"] == "5"
    assert open_checkpoint(path).read_value("meta.dcp_zarr") == 5


def test_a_root_value_named_as_the_manifest_is_left_out_and_loads_back(tmp_path):
    path = str(tmp_path / "clash.zarr")
    save_plain({"dcp_zarr": "mine", "w": torch.ones(2)}, path)

    root = zarr.open_group(path, mode="r")
    assert sorted(root.attrs) == ["dcp_zarr"] and root.attrs["dcp_zarr"]["format"] == "dcp_zarr"
    state = {"dcp_zarr": None, "w": torch.zeros(2)}
    dcp.load(state, storage_reader=ZarrReader(path))
    assert state["dcp_zarr"] == "mine"


def test_dcp_zarr_loads_the_manifest_not_attributes_edited_afterwards(tmp_path):
    path = str(tmp_path / "edited.zarr")
    save_plain({"optim": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}, "w": torch.ones(2)}, path)
    zarr.open_group(path, mode="r+", use_consolidated=False)["optim/param_groups/0"].attrs["lr"] = 5.0

    state = {"optim": {"param_groups": [{"lr": 0.0, "params": []}]}, "w": torch.zeros(2)}
    dcp.load(state, storage_reader=ZarrReader(path))
    assert state["optim"]["param_groups"][0]["lr"] == 0.1


# ---- saves without values: as before ---------------------------------------------------------------------------------


def test_a_save_without_values_writes_groups_without_attributes(tmp_path):
    path = tmp_path / "tensors.zarr"
    save_plain({"model": {"a.w": torch.ones(2)}, "optim": {"state": {"a.w": {"step": torch.tensor(1.0)}}}}, str(path))

    for group in ("model", "optim", "optim/state", "optim/state/a.w"):
        assert (path / group / "zarr.json").read_bytes() == b'{"zarr_format":3,"node_type":"group","attributes":{}}'
    root = json.loads((path / "zarr.json").read_text())
    assert list(root["attributes"]) == ["dcp_zarr"]


# ---- the pure parts --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [(0.9, 0.999), [(1, "a"), {"b": (None,)}], {"__x": 1}, {"a": {"b": [True]}}, "",
                                   0, -0.0, 10**30])
def test_plain_json_gives_the_value_with_tuples_as_lists(value):
    assert plain_json(encode_value(value)) == plain(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), b"x", {1}, frozenset(), io.BytesIO(b""), np.int8(1),
                                   np.zeros(2), {1: "a"}, {(1, 2): "a"}, [1, {"a": float("-inf")}]])
def test_plain_json_refuses_what_it_cannot_hold_exactly(value):
    with pytest.raises(NotPlainJSONError):
        plain_json(encode_value(value))


def test_group_attributes_follow_the_state_dicts_order_and_skip_tensors_and_objects():
    entries = {
        "g.b": ValueEntry("g.b", ("g", "b"), "g/b", 2),
        "g.t": TensorEntry("g.t", ("g", "t"), "g/t", "torch.float32", (1,), (1,)),
        "g.o": ObjectEntry("g.o", ("g", "o"), "g/o", 10),
        "g.a": ValueEntry("g.a", ("g", "a"), "g/a", {"__tuple__": [1]}),
        "h.nan": ValueEntry("h.nan", ("h", "nan"), "h/nan", {"__float__": "nan"}),
        "top": ValueEntry("top", ("top",), "top", "x"),
    }
    attributes = group_attributes(entries, ["top", "g.a", "g.t", "g.o", "g.b", "h.nan"])

    nan = {"entry": "h.nan", "kind": "float", "repr": "nan",
           "read": "float(manifest['entries']['h.nan']['value']['__float__'])"}
    assert attributes == {"": {"top": "x"}, "g": {"a": [1], "b": 2}, "h": {"dcp_zarr": {"values": {"nan": nan}}}}
    assert list(attributes["g"]) == ["a", "b"]
    assert group_attributes({"nan": ValueEntry("nan", ("nan",), "nan", {"__float__": "nan"})}) == {}  # the manifest
    assert group_attributes({"t": entries["g.t"]}) == {}
