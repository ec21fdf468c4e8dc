"""One-element tensors kept in their array's fill_value, with no chunk (format 7, format/fill_values.py): what is kept
and what is not, read back exactly by dcp_zarr and by zarr-python, by either way of planning a save, and a manifest or
zarr.json that disagrees refused by name."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import ZarrWriter, open_checkpoint
from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.testing.planners import DCPsPlanning
from dcp_zarr.tools.cli import main
from tests.support.compare import assert_state_equal
from tests.support.faults import causes
from tests.support.states import load_full, save_plain
from tests.support.stores import drop_root_copies, edit_json, edit_root_manifest, root_manifest

KEPT = {  # name -> the value its fill_value holds
    "step": (torch.tensor(7.0), 7.0),
    "neg_zero": (torch.tensor(-0.0), -0.0),
    "count": (torch.tensor(-(2**53)), -(2**53)),  # the largest magnitude a JSON reader in JavaScript parses exactly
    "flag": (torch.tensor([False]), False),  # (a load's blank bool tensor is all True)
    "half": (torch.tensor([[0.1]], dtype=torch.float16), float(torch.tensor(0.1, dtype=torch.float16))),
    "byte": (torch.tensor(255, dtype=torch.uint8), 255),
    "tiny": (torch.tensor(1e-45), float(torch.tensor(1e-45))),  # float32's smallest subnormal
}
CHUNKED = {  # one element, but stored as a chunk
    "nan": torch.tensor(float("nan")),
    "inf": torch.tensor(float("-inf")),
    "bf16": torch.tensor(1.5, dtype=torch.bfloat16),
    "complex": torch.tensor(1 + 2j, dtype=torch.complex64),
    "two": torch.tensor([1.0, 2.0]),
    "big": torch.tensor(2**53 + 1),  # JavaScript's JSON.parse would read 2**53
}


def state() -> dict:
    return {"kept": {name: tensor for name, (tensor, _) in KEPT.items()}, "chunked": dict(CHUNKED)}


def _files(path, node: str) -> list[str]:
    return sorted(os.listdir(os.path.join(path, node)))


@pytest.mark.parametrize("planning", ["local", "dcp"])
def test_kept_tensors_have_no_chunk_and_read_back_exactly_everywhere(tmp_path, planning):
    path = str(tmp_path / "ckpt.zarr")
    planner = {"planner": DCPsPlanning()} if planning == "dcp" else {}
    dcp.save(state(), storage_writer=ZarrWriter(path), no_dist=True, **planner)

    entries = root_manifest(path)["entries"]
    group = zarr.open_group(path, mode="r")
    for name, (tensor, value) in KEPT.items():
        assert _files(path, f"kept/{name}") == ["zarr.json"], name
        assert entries[f"kept.{name}"]["fill"] == value and type(entries[f"kept.{name}"]["fill"]) is type(value)
        stored = group[f"kept/{name}"][...]
        assert stored.shape == tuple(tensor.shape) and stored.tolist() == tensor.tolist(), name
    assert math.copysign(1, group["kept/neg_zero"][()]) == -1, "zarr-python reads -0.0"
    for name in CHUNKED:
        assert "fill" not in entries[f"chunked.{name}"] and len(_files(path, f"chunked/{name}")) == 2, name

    back = load_full(path, state())
    assert_state_equal(back, state())
    assert torch.signbit(back["kept"]["neg_zero"]), "the sign of -0.0 survives"
    ckpt = open_checkpoint(path)
    assert ckpt.entry("kept.count").fill == -(2**53) and ckpt.read_tensor("chunked.big").item() == 2**53 + 1


def test_verify_and_inspect_count_no_chunk_for_a_kept_tensor(tmp_path, capsys):
    path = str(tmp_path / "ckpt.zarr")
    save_plain(state(), path)

    assert main(["verify", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] == len(CHUNKED)
    assert main(["inspect", path, "--json"]) == 0
    rows = {row["fqn"]: row for row in json.loads(capsys.readouterr().out)["entries"]}
    assert (rows["kept.step"]["chunks"], rows["kept.step"]["stored_bytes"]) == (0, 0)
    assert rows["chunked.bf16"]["chunks"] == 1 and rows["chunked.bf16"]["stored_bytes"] > 0


@pytest.mark.parametrize("own", [False, True], ids=["copy", "own zarr.json"])
def test_a_zarr_json_whose_fill_value_disagrees_with_the_manifest_is_refused(tmp_path, own, capsys):
    """zarr tools read the fill_value and dcp_zarr the manifest: a store where they differ would read two ways."""
    path = str(tmp_path / "ckpt.zarr")
    save_plain(state(), path)
    if own:
        drop_root_copies(path)
        edit_json(os.path.join(path, "kept", "step", "zarr.json"), lambda doc: doc.update(fill_value=8.0))
    else:
        edit_root_manifest(path, lambda manifest: manifest["nodes"]["kept/step"].update(fill_value=8.0))

    with pytest.raises(CheckpointException) as raised:
        load_full(path, state())
    [cause] = causes(raised.value)
    assert isinstance(cause, MalformedMetadataError)
    assert "'kept/step' of entry 'kept.step': zarr.json has fill_value 8.0, but the manifest says the array holds " \
        "7.0" in str(cause)
    if own:
        assert main(["verify", path]) == 1
        assert "fill_value 8.0" in capsys.readouterr().out


@pytest.mark.parametrize("fill, message", [
    ("7", "fill '7' is not a finite float32 value"),
    (float("inf"), "fill inf is not a finite float32 value"),
    (True, "fill True is not a finite float32 value"),
])
def test_a_malformed_fill_in_the_manifest_is_refused_naming_the_entry(tmp_path, fill, message):
    path = str(tmp_path / "ckpt.zarr")
    save_plain(state(), path)
    edit_root_manifest(path, lambda manifest: manifest["entries"]["kept.step"].update(fill=fill))

    refused = f"ckpt.zarr.*: manifest entry 'kept.step' is malformed: {message}"
    with pytest.raises(MalformedMetadataError, match=refused):
        open_checkpoint(path)


def test_a_fill_for_an_array_of_more_elements_or_of_an_older_format_is_refused(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    save_plain(state(), path)
    edit_root_manifest(path, lambda manifest: manifest["entries"]["chunked.two"].update(fill=1.0))
    refused = r"entry 'chunked.two' is malformed: fill 1.0: .*not shape \[2\] float32"
    with pytest.raises(MalformedMetadataError, match=refused):
        open_checkpoint(path)

    edit_root_manifest(path, lambda manifest: (manifest["entries"]["chunked.two"].pop("fill"),
                                               manifest.update(format_version=6)))
    with pytest.raises(MalformedMetadataError, match="entry 'kept.step' is malformed: fill 7.0 in a format-6 store"):
        open_checkpoint(path)


def test_a_kept_tensor_loads_into_a_destination_of_another_dtype_or_shape_of_one(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    save_plain({"step": torch.tensor(5.0)}, path)
    back = load_full(path, {"step": torch.zeros((), dtype=torch.float64)})
    assert back["step"].dtype == torch.float64 and back["step"].item() == 5.0
