"""Readers we do not control read the checkpoints dcp_zarr writes (issue 50): zarr-python alone, in a venv with nothing
of ours (zarr 3.1 on Python 3.11, the newest on 3.12); the reading install (``pip install .`` without torch) with
zarr-python, xarray and the zarrs codec pipeline; TensorStore; zarrita.js. Three checkpoints (uncompressed,
``compression=True``, ``"zstd"``) of every dtype a model or its optimizer holds, 0-d tensors included. What a
reader cannot read is its own limit, listed in docs/offline-and-cli.md: each such case is asserted here as the
reader's error, so the table stays true."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorstore as ts
import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import ZarrWriter
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.offline import open_checkpoint
from tests.readers import environments
from tests.support.states import random_bits
from tests.support.stores import tree_digest

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

HERE = os.path.dirname(os.path.abspath(__file__))
# node -> tensor: every dtype a training state holds; the floats large enough (64 KiB) to be compressed
TENSORS = {
    "model/fp32": (torch.float32, (256, 128)), "model/fp16": (torch.float16, (300, 200)),
    "model/bf16": (torch.bfloat16, (256, 256)), "model/fp8_e4m3fn": (torch.float8_e4m3fn, (256, 512)),
    "model/fp8_e5m2": (torch.float8_e5m2, (64, 8)), "model/int64": (torch.int64, (10,)),
    "model/bool": (torch.bool, (7,)), "model/complex64": (torch.complex64, (4, 3)),
    "optim/state/fp32/step": (torch.float32, ()), "extra/count": (torch.int64, ()),
}
UNKNOWN_TO_ZARR = {"model/bf16": "bfloat16", "model/fp8_e4m3fn": "float8_e4m3fn", "model/fp8_e5m2": "float8_e5m2"}
COMPRESSIONS = {"uncompressed": None, "compression=True": True, "zstd": "zstd"}


def _values(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Floats drawn as trained weights are, N(0, 0.02), so that they compress (float8 in its normal range); the
    rest every bit pattern."""
    if not dtype.is_floating_point or not shape:
        return random_bits(shape, dtype, seed=seed)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    return (values * 20).to(dtype) if dtype.itemsize == 1 else values.to(dtype)


def state() -> dict:
    flat = {node: _values(shape, dtype, i) for i, (node, (dtype, shape)) in enumerate(TENSORS.items())}
    nested: dict = {}
    for node, tensor in flat.items():
        *groups, name = node.split("/")
        target = nested
        for group in groups:
            target = target.setdefault(group, {})
        target[name] = tensor
    return nested


def expected() -> dict[str, list]:
    """node -> [numpy dtype, shape, sha256 of the bytes], as every reader must report it."""
    found = {}
    for node, tensor in zip(TENSORS, _leaves(state())):
        array = tensor_as_numpy(tensor)
        found[node] = [str(array.dtype), list(array.shape), hashlib.sha256(array.tobytes()).hexdigest()]
    return found


def _leaves(tree: dict) -> list[torch.Tensor]:
    return [x for v in tree.values() for x in (_leaves(v) if isinstance(v, dict) else [v])]


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("readers")
    paths = {}
    for name, compression in COMPRESSIONS.items():
        paths[name] = str(root / f"{name.replace('=', '-')}.zarr")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state(), storage_writer=ZarrWriter(paths[name], compression=compression), no_dist=True)
    codecs = {name: {e.fqn for e in open_checkpoint(p) if e.codec} for name, p in paths.items()}
    assert not codecs["uncompressed"] and {"model.fp32", "model.bf16"} <= codecs["zstd"] == codecs["compression=True"]
    return paths


@pytest.fixture(scope="module")
def untouched(stores):
    """Every file of every store as saved: readers must leave them so."""
    before = {name: tree_digest(path) for name, path in stores.items()}
    yield
    assert {name: tree_digest(path) for name, path in stores.items()} == before


def read_with(interpreter: str, store: str) -> dict:
    done = subprocess.run([interpreter, os.path.join(HERE, "zarr_read.py"), store, *TENSORS], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(store))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("version", ["3.11", "3.12"])
def test_zarr_python_alone_opens_every_checkpoint_and_reads_every_array_of_a_type_it_knows(version, stores,
                                                                                          untouched):
    interpreter = environments.zarr_alone(version)
    for name, store in stores.items():
        report = read_with(interpreter, store)

        assert not report["torch_installed"] and not report["dcp_zarr_installed"], report
        release = tuple(int(part) for part in report["zarr"].split(".")[:2])
        assert release == (3, 1) if version == "3.11" else release >= (3, 4), report["zarr"]
        for node, described in expected().items():
            if node in UNKNOWN_TO_ZARR:  # fails on its own, naming its data type: zarr-python's limit
                assert report["arrays"][node].startswith("error: ValueError: No Zarr data type found"), (name, node)
                assert f"'{UNKNOWN_TO_ZARR[node]}'" in report["arrays"][node], (name, node)
            else:
                assert report["arrays"][node] == described, (name, node)
        # zarr-python's listing parses every member and stops at the first type it does not know (its limit, in the
        # docs; the reading install lifts it)
        assert report["listing"].startswith("error: ValueError: No Zarr data type found"), report["listing"]


def test_the_reading_install_has_no_torch_and_reads_and_lists_every_array_with_zarr_zarrs_and_xarray(stores,
                                                                                                     untouched):
    interpreter = environments.reading_install()
    for name, store in stores.items():
        report = read_with(interpreter, store)

        assert not report["torch_installed"] and report["dcp_zarr_installed"], report
        assert report["arrays"] == expected(), name
        assert report["zarrs"] == expected(), name
        assert report["xarray"] == expected(), name
        groups = {"model", "optim", "optim/state", "optim/state/fp32", "extra"}
        assert report["listing"] == sorted(groups | set(TENSORS)), name


def _command(interpreter: str, *args: str) -> subprocess.CompletedProcess:
    cli = os.path.join(os.path.dirname(interpreter), "dcp-zarr")
    return subprocess.run([cli, *args], capture_output=True, text=True, timeout=300)


def test_the_reading_install_runs_the_commands_that_look_and_converts_to_safetensors(stores, untouched, tmp_path):
    interpreter = environments.reading_install()
    store, other = stores["zstd"], stores["uncompressed"]
    assert _command(interpreter, "inspect", store).returncode == 0
    assert _command(interpreter, "verify", "--no-progress", store).returncode == 0
    assert _command(interpreter, "diff", store, other).returncode == 0  # the same values, compressed or not
    root = tmp_path / "steps"
    root.mkdir()
    shutil.copytree(store, root / "step-00000007.zarr")
    listed = _command(interpreter, "list", str(root))
    assert listed.returncode == 0 and "step-00000007.zarr" in listed.stdout and "complete" in listed.stdout, listed
    out = str(tmp_path / "weights.safetensors")

    converted = _command(interpreter, "convert", store, out, "--to", "safetensors")

    assert converted.returncode == 0, converted.stderr
    from safetensors.torch import load_file

    weights = load_file(out)
    for node, tensor in zip(TENSORS, _leaves(state())):
        if node.startswith("model/"):
            assert weights[node.removeprefix("model/")].dtype == tensor.dtype, node
            assert tensor_as_numpy(weights[node.removeprefix("model/")]).tobytes() == \
                tensor_as_numpy(tensor).tobytes(), node


def test_in_the_reading_install_the_dcp_parts_fail_with_one_error_naming_torch_and_the_fix(stores, tmp_path):
    interpreter = environments.reading_install()
    done = subprocess.run([interpreter, "-c", "from dcp_zarr import ZarrWriter"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("dcp_zarr.errors.TorchRequiredError: ") and "pip install 'torch>=" in last, last

    converted = _command(interpreter, "convert", stores["zstd"], str(tmp_path / "again.zarr"), "--to", "zarr")
    assert converted.returncode == 2 and "TorchRequiredError" not in converted.stderr, converted.stderr
    assert "need torch>=" in converted.stderr and "cannot be imported here" in converted.stderr, converted.stderr


def test_tensorstore_reads_every_array(stores, untouched):
    for name, store in stores.items():
        for node, described in expected().items():
            array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{store}/{node}"}},
                            read=True).result().read().result()
            data = np.asarray(array)
            assert [str(data.dtype), list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()] == described, \
                (name, node)


# zarrita.js 0.7.5 has no float16 (Node 20 has no Float16Array), bfloat16, float8 or complex64 data type
ZARRITA_CANNOT = {"model/fp16", "model/bf16", "model/fp8_e4m3fn", "model/fp8_e5m2", "model/complex64"}


def test_zarrita_js_reads_every_array_of_a_type_it_knows(stores, untouched):
    home = environments.zarrita()
    for name, store in stores.items():
        done = subprocess.run(["node", str(home / "zarrita_read.mjs"), store, *TENSORS], capture_output=True,
                              text=True, timeout=300, cwd=home)
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        for node, (_, shape, digest) in expected().items():
            if node in ZARRITA_CANNOT:
                assert isinstance(found[node], str) and found[node].startswith("error: "), (name, node, found[node])
            else:
                assert found[node][1:] == [shape, digest], (name, node, found[node])


assert sys.byteorder == "little"  # the digests compare bytes as stored, little-endian
