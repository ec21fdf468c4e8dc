"""A checkpoint written by 2 ranks opens in zarr-python (as saved, and after zarr consolidated its metadata), xarray
and TensorStore's zarr3 driver: every dtype (bf16 and fp8 included), sharded arrays, 0-d step arrays, with
bit-identical values. (Readers that never saw dcp_zarr, and the torch-free install: tests/readers/.)"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorstore as ts
import torch
import torch.distributed.checkpoint as dcp
import xarray as xr
import zarr
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.offline import open_checkpoint
from tests.support.ranks import run_ranks
from tests.support.states import DTYPES, random_bits
from tests.support.stores import root_copies

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part")]

# With 1 KiB inner chunks the two 64-row arrays become shards (32 rows each) of several inner chunks.
INNER_BYTES = 1024
SHARDED = {"big_f32": (torch.float32, (64, 40)), "big_bf16": (torch.bfloat16, (64, 40))}


def expected_model() -> dict[str, torch.Tensor]:
    """The full tensors every rank shards (13 rows: 7 on rank 0, 6 on rank 1)."""
    tensors = {str(dtype).removeprefix("torch."): random_bits((13, 3), dtype, seed=i) for i, dtype in enumerate(DTYPES)}
    for i, (name, (dtype, shape)) in enumerate(SHARDED.items()):
        tensors[name] = random_bits(shape, dtype, seed=100 + i)
    return tensors


def expected_steps() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(3.0), "v": torch.tensor(5, dtype=torch.int64)}


# Values of a param group: zarr shows them as the group's attributes, all but eps (plain JSON has no NaN), which the
# group's dcp_zarr attribute describes.
PARAM_GROUP = {"lr": 0.1, "betas": (0.9, 0.95), "eps": float("nan"), "amsgrad": False, "fused": None,
               "params": ["w", "v"]}
PARAM_GROUP_ATTRIBUTES = {"lr": 0.1, "betas": [0.9, 0.95], "amsgrad": False, "fused": None, "params": ["w", "v"]}


def _save_on_ranks(rank, world_size, path, options=None):
    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    for name, full in expected_model().items():
        local = full.chunk(world_size)[rank].clone()  # torch.chunk's split is Shard(0)'s
        model[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                         stride=full.stride())
    optim = {"state": {k: {"step": v} for k, v in expected_steps().items()}, "param_groups": [PARAM_GROUP]}
    dcp.save({"model": model, "optim": optim}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(path, inner_chunk_bytes=INNER_BYTES, **(options or {})))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("interop") / "ckpt.zarr"
    run_ranks(_save_on_ranks, 2, str(path))
    return path


@pytest.fixture(scope="module")
def consolidated(store, tmp_path_factory):
    copy = tmp_path_factory.mktemp("consolidated") / "ckpt.zarr"
    shutil.copytree(store, copy)
    zarr.consolidate_metadata(str(copy))
    return copy


def expected_arrays() -> dict[str, torch.Tensor]:
    """zarr node -> the tensor it must hold."""
    arrays = {f"model/{name}": t for name, t in expected_model().items()}
    arrays.update({f"optim/state/{k}/step": v for k, v in expected_steps().items()})
    return arrays


def assert_same_bits(array: np.ndarray, tensor: torch.Tensor, node: str) -> None:
    expected = tensor_as_numpy(tensor)
    array = np.asarray(array)
    assert array.dtype == expected.dtype, f"{node}: {array.dtype} vs {expected.dtype}"
    assert array.shape == expected.shape, f"{node}: {array.shape} vs {expected.shape}"
    assert array.tobytes() == expected.tobytes(), f"{node}: values differ"


def test_the_store_really_has_sharded_and_scalar_arrays(store):
    ckpt = open_checkpoint(store)

    assert ckpt.saved_world_size == 2
    assert all(ckpt.entries[f"model.{name}"].inner_chunk_rows > 0 for name in SHARDED)
    assert ckpt.entries["optim.state.w.step"].shape == ()
    assert ckpt.entries["model.bfloat16"].saved_shards == 2  # written by two ranks


@pytest.mark.parametrize("which", ["as saved", "consolidated by zarr"])
def test_zarr_python_reads_every_array_bit_exact(which, store, consolidated):
    group = zarr.open_group(str(consolidated if which == "consolidated by zarr" else store), mode="r")

    # as saved, no consolidated metadata: zarr-python would parse it whole on opening (format/node_copies.py)
    assert (group.metadata.consolidated_metadata is not None) == (which == "consolidated by zarr")
    for node, tensor in expected_arrays().items():
        array = group[node]
        assert_same_bits(array[...], tensor, node)
    big = group["model/big_f32"]  # the zarr view of our sharding: one shard spanning the array, both ranks' rows
    assert big.shards == (64, 40) and big.chunks[0] < 32 and big.chunks[1] == 40, (big.shards, big.chunks)
    assert_same_bits(group["model/big_bf16"][5:37, 3:9], expected_model()["big_bf16"][5:37, 3:9], "big_bf16 slice")


def _root(path) -> dict:
    with open(f"{path}/zarr.json") as f:
        return json.load(f)


def test_the_roots_copies_are_what_each_node_says_and_what_zarr_would_consolidate(store, consolidated):
    ours = root_copies(store)

    assert "consolidated_metadata" not in _root(store)
    assert ours == {node: {k: v for k, v in document.items() if k != "consolidated_metadata"}
                    for node, document in _root(consolidated)["consolidated_metadata"]["metadata"].items()}
    for node, document in ours.items():
        assert _root(f"{store}/{node}") == document, node


def test_dcp_zarr_still_loads_a_store_after_zarr_consolidates_it(consolidated):
    state = {"model": {n: torch.empty_like(t) for n, t in expected_model().items()},
             "optim": {"state": {k: {"step": torch.zeros_like(v)} for k, v in expected_steps().items()}}}

    dcp.load(state, storage_reader=ZarrReader(consolidated), no_dist=True)

    for name, tensor in expected_model().items():
        assert_same_bits(tensor_as_numpy(state["model"][name]), tensor, name)


def _tensorstore(path, node, **extra):
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/{node}"}, **extra}
    return ts.open(spec, read=True).result()


def test_tensorstore_reads_every_array_bit_exact(store):
    for node, tensor in expected_arrays().items():
        array = _tensorstore(store, node)
        assert array.dtype.name == str(tensor.dtype).removeprefix("torch."), node
        assert_same_bits(array.read().result(), tensor, node)


def test_tensorstore_reads_regions_of_sharded_arrays(store):
    full = expected_model()["big_f32"]
    array = _tensorstore(store, "model/big_f32")

    assert_same_bits(array[29:35, 1:7].read().result(), full[29:35, 1:7], "big_f32 across the two ranks' shards")


def test_tensorstore_reads_the_consolidated_copy_too(consolidated):
    assert_same_bits(_tensorstore(consolidated, "model/float8_e4m3fn").read().result(),
                     expected_model()["float8_e4m3fn"], "fp8")


# ---- aggregated arrays (collective I/O): blocks of rows, each one rank's chunk, shards of inner chunks -------------

# every array aggregated, in blocks of 3 KiB: the 64 float32 rows of 40 are 4 blocks of 18 rows (inner chunks of 6)
AGGREGATED = {"aggregate_below": 1 << 40, "exchange_bytes": 3 * INNER_BYTES}


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory):
    path = tmp_path_factory.mktemp("aggregated") / "ckpt.zarr"
    run_ranks(_save_on_ranks, 2, str(path), AGGREGATED)
    return path


def test_an_aggregated_store_reads_bit_exact_in_zarr_python_tensorstore_and_xarray(aggregated):
    big = open_checkpoint(aggregated).entries["model.big_f32"]
    assert (big.chunk_shape, big.inner_chunk_rows) == ((18, 40), 6), big
    group = zarr.open_group(str(aggregated), mode="r")
    tree = xr.open_datatree(str(aggregated), engine="zarr", consolidated=False)
    for node, tensor in expected_arrays().items():
        assert_same_bits(group[node][...], tensor, f"zarr-python: {node}")
        assert_same_bits(_tensorstore(aggregated, node).read().result(), tensor, f"TensorStore: {node}")
        parent, _, name = node.rpartition("/")
        assert_same_bits(tree[parent][name].values, tensor, f"xarray: {node}")
    full = expected_model()["big_f32"]  # a region across blocks and inner chunks
    assert_same_bits(_tensorstore(aggregated, "model/big_f32")[10:27, 3:9].read().result(), full[10:27, 3:9],
                     "big_f32 across blocks")


# ---- zarr-python without dcp_zarr: the data types come from the zarr.data_type entry points -------------------------

_WITHOUT_DCP_ZARR = r"""
import hashlib, json, sys
sys.modules["torch"] = None  # `import torch` raises: proves nothing here needs it
import zarr

try:  # first, an array opened by its own path, not through its group
    direct = str(zarr.open_array(sys.argv[1] + "/model/bfloat16", mode="r").dtype)
except ValueError as exc:
    direct = f"refused: {exc}"
group = zarr.open_group(sys.argv[1], mode="r")
found = {}
for node, array in group.members(max_depth=None):  # one unknown data type would break this walk of the whole group
    if isinstance(array, zarr.Array):
        data = array[...]
        found[node] = [str(data.dtype), list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()]
attributes = {node: dict(g.attrs) for node, g in group.members(max_depth=None) if isinstance(g, zarr.Group)}
print(json.dumps({"arrays": found, "direct": direct, "attributes": attributes,
                  "modules": sorted(m for m in sys.modules if m.startswith("dcp_zarr"))}))
"""


@pytest.fixture(scope="module")
def without_dcp_zarr(store) -> dict:
    """What a program that never imports dcp_zarr reads of the store with zarr-python."""
    done = subprocess.run([sys.executable, "-c", _WITHOUT_DCP_ZARR, str(store)], capture_output=True, text=True,
                          timeout=120, cwd=str(store.parent))

    assert done.returncode == 0, done.stderr
    assert "Task exception was never retrieved" not in done.stderr
    return json.loads(done.stdout)


def test_zarr_python_opens_bf16_and_fp8_arrays_in_a_program_that_never_imports_dcp_zarr(without_dcp_zarr):
    report = without_dcp_zarr
    for node, tensor in expected_arrays().items():
        expected = tensor_as_numpy(tensor)
        assert report["arrays"][node] == [str(expected.dtype), list(expected.shape),
                                          hashlib.sha256(expected.tobytes()).hexdigest()], node
    # zarr 3.4 loads the zarr.data_type entry points whenever it resolves a data type; 3.1-3.3 only load the
    # zarr.buffer one, which opening a group does first but zarr.open_array of an array path does not (README).
    if tuple(int(p) for p in zarr.__version__.split(".")[:2]) >= (3, 4):
        assert report["direct"] == "bfloat16"
    else:
        assert report["direct"].startswith("refused: No Zarr data type found that matches 'bfloat16'")
    # zarr itself loaded only the torch-free data-type module (and the package it lives in), nothing of the save path
    assert set(report["modules"]) <= {"dcp_zarr", "dcp_zarr.errors", "dcp_zarr.version", "dcp_zarr.format",
                                      "dcp_zarr.format.zarr_dtypes",
                                      "dcp_zarr.format.dtype_table"}  # the dtype table: numpy and ml_dtypes only
    assert "dcp_zarr.format.zarr_dtypes" in report["modules"]


def test_zarr_python_without_dcp_zarr_shows_the_param_groups_values_as_its_attributes(without_dcp_zarr):
    attributes = without_dcp_zarr["attributes"]

    shown = attributes["optim/param_groups/0"]
    assert {name: value for name, value in shown.items() if name != "dcp_zarr"} == PARAM_GROUP_ATTRIBUTES
    assert shown["dcp_zarr"]["values"]["eps"]["repr"] == "nan"
    assert attributes["model"] == attributes["optim"] == attributes["optim/param_groups"] == {}


# ---- xarray: every array has dimension_names, none shared between arrays -------------------------------------------


def _arrays(group: zarr.Group) -> dict[str, zarr.Array]:
    return {node: a for node, a in group.members(max_depth=None) if isinstance(a, zarr.Array)}


def test_every_array_has_dimension_names_that_no_other_array_uses(store):
    arrays = _arrays(zarr.open_group(str(store), mode="r"))
    names = [name for a in arrays.values() for name in a.metadata.dimension_names]

    assert all(len(a.metadata.dimension_names) == a.ndim for a in arrays.values())
    assert len(names) == len(set(names))
    assert arrays["model/big_f32"].metadata.dimension_names == ("model/big_f32.dim0", "model/big_f32.dim1")


@pytest.mark.parametrize("use_consolidated", [None, False])
def test_xarray_opens_the_whole_store_as_a_datatree_bit_exact(store, use_consolidated):
    if use_consolidated is None:  # xarray's default tries zarr's consolidated metadata first, and says it found none
        with pytest.warns(RuntimeWarning, match="Failed to open Zarr store with consolidated metadata"):
            tree = xr.open_datatree(str(store), engine="zarr")
    else:
        tree = xr.open_datatree(str(store), engine="zarr", consolidated=False)

    for node, tensor in expected_arrays().items():
        group, _, name = node.rpartition("/")
        assert_same_bits(tree[group][name].values, tensor, node)


def _fsdp2_save(rank, world_size, path):
    from tests.support.models import train_and_save

    return train_and_save(rank, world_size, "fsdp2", ZarrWriter(path))[0]


@pytest.fixture(scope="module")
def fsdp2_store(tmp_path_factory):
    """An FSDP2 model and its AdamW saved by 2 ranks through the plain line (DCP's own planner, taken over), and the
    full state rank 0 saw."""
    path = tmp_path_factory.mktemp("fsdp2") / "fsdp2.zarr"
    return path, run_ranks(_fsdp2_save, 2, str(path))[0]


def test_xarray_opens_an_fsdp2_checkpoint_group_by_group(fsdp2_store):
    path, _ = fsdp2_store
    ckpt = open_checkpoint(path)
    tensors = {fqn: e for fqn, e in ckpt.entries.items() if e.kind == "tensor"}
    assert any(fqn.endswith("exp_avg_sq") for fqn in tensors) and any(fqn.endswith(".step") for fqn in tensors)

    tree = xr.open_datatree(str(path), engine="zarr", consolidated=False)
    for fqn, entry in tensors.items():
        group, _, name = entry.node.rpartition("/")
        assert_same_bits(tree[group][name].values, ckpt.read_tensor(fqn), fqn)
    weights = xr.open_zarr(str(path), group="model", consolidated=False)
    some = next(fqn for fqn in tensors if fqn.startswith("model."))
    assert_same_bits(weights[tensors[some].node.removeprefix("model/")].values, ckpt.read_tensor(some), some)


def test_zarr_python_shows_the_adamw_hyperparameters_of_an_fsdp2_save_exactly(fsdp2_store):
    path, saved = fsdp2_store
    (group,) = saved["optim"]["param_groups"]

    attributes = dict(zarr.open_group(str(path), mode="r")["optim/param_groups/0"].attrs)
    assert attributes == {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
    assert attributes["lr"] == 1e-2 and attributes["weight_decay"] == 0.01 and attributes["betas"] == [0.9, 0.999]
    assert attributes["params"] == group["params"] and "blocks.0.up.weight" in attributes["params"]
