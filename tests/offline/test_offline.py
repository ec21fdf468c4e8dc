"""The offline API: open a checkpoint, list entries, read tensors or regions lazily, load it all - no process group."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint import FileSystemWriter

from dcp_zarr import (
    CorruptChunkError,
    IncompleteCheckpointError,
    NotACheckpointError,
    UntrustedTypeError,
    UntrustedTypeWarning,
    ZarrSavePlanner,
    ZarrWriter,
)
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.storage.local import LocalStorage, OpenFile
from tests.support.compare import assert_state_equal
from tests.support.models import train_and_save
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Small inner chunks, so a 96 KiB tensor is stored as a shard of 8 inner chunks and regions can skip some.
INNER_BYTES = 12 * 1024


def sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(96, 256, generator=g),  # 96 KiB: sharded, 12 rows per inner chunk
            "norm.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "proj.weight": torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
            "mask": torch.rand(4, 4, generator=g) > 0.5,
            "empty": torch.empty(0, 3),
        },
        "optim": {
            "state": {"embed.weight": {"step": torch.tensor(7.0), "exp_avg": torch.randn(96, 256, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["embed.weight"]}],
        },
        "trainer": {"epoch": 3, "history": [0.5, float("nan")], "ids": {1: "a"}},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("offline") / "ckpt.zarr"
    state = sample_state()
    dcp.save(state, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path, inner_chunk_bytes=INNER_BYTES))
    return path, sample_state()


@pytest.fixture
def copy_of(saved, store_copy):
    """A private copy of the saved store, for tests that break it."""
    return lambda: store_copy(saved[0])


def test_entries_describe_every_saved_key_from_the_manifest_alone(copy_of):
    path = copy_of()
    for dirpath, _, files in os.walk(path):  # leave only the root zarr.json: listing must read nothing else
        for name in files:
            if os.path.join(dirpath, name) != os.path.join(path, "zarr.json"):
                os.remove(os.path.join(dirpath, name))

    ckpt = open_checkpoint(path)

    embed = ckpt.entries["model.embed.weight"]
    assert (embed.kind, embed.dtype, embed.shape, embed.nbytes) == ("tensor", torch.float32, (96, 256), 96 * 256 * 4)
    assert embed.node == "model/embed.weight" and embed.path == ("model", "embed.weight")
    assert embed.inner_chunk_rows == 12 and embed.chunk_shape == (96, 256)
    assert ckpt.entries["model.norm.bias"].dtype == torch.bfloat16
    assert ckpt.entries["optim.state.embed.weight.step"].shape == ()
    assert ckpt.entries["optim.param_groups.0.lr"].kind == "value"
    assert ckpt.entries["optim.param_groups.0.lr"].path == ("optim", "param_groups", 0, "lr")
    assert (ckpt.saved_world_size, ckpt.state_dict_type) == (1, "full")
    assert "model/embed.weight" in ckpt and "model.embed.weight" in ckpt


def test_read_array_gives_the_same_bits_as_read_tensor_in_numpy_types(saved):
    path, state = saved
    ckpt = open_checkpoint(path)

    for name, tensor in state["model"].items():
        array = ckpt.read_array(f"model.{name}")
        assert array.dtype == ckpt.entries[f"model.{name}"].numpy_dtype and array.shape == tuple(tensor.shape)
        assert array.tobytes() == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
    assert str(ckpt.read_array("model.norm.bias").dtype) == "bfloat16"  # ml_dtypes', not raw bits
    assert ckpt.read_array("model.embed.weight", region=(slice(10, 14), 3)).tolist() == \
        state["model"]["embed.weight"][10:14, 3].tolist()
    assert ckpt.read_array("optim.state.embed.weight.step").item() == 7.0


def test_read_tensor_returns_the_saved_bits_for_every_dtype(saved):
    path, state = saved
    ckpt = open_checkpoint(path)

    for name, tensor in state["model"].items():
        read = ckpt.read_tensor(f"model.{name}")
        assert read.dtype == tensor.dtype and read.shape == tensor.shape
        assert torch.equal(read.view(torch.uint8), tensor.view(torch.uint8)), name
    assert ckpt.read_tensor("optim/state/embed.weight/step").item() == 7.0  # by zarr node path too


def test_a_region_reads_only_the_chunks_under_it(saved, copy_of):
    path = copy_of()
    shard = path / "model" / "embed.weight" / "c.0.0"
    data = bytearray(shard.read_bytes())
    inner = 12 * 256 * 4 + 4  # one inner chunk and its crc32c; they are laid out in order from offset 0
    data[5 * inner + 100] ^= 0xFF  # corrupt inner chunk 5 (rows 60..71)
    shard.write_bytes(bytes(data))
    expected = saved[1]["model"]["embed.weight"]
    ckpt = open_checkpoint(path)

    rows = ckpt.read_tensor("model.embed.weight", region=(slice(10, 59), slice(3, 40)))

    assert torch.equal(rows, expected[10:59, 3:40])
    with pytest.raises(CorruptChunkError, match=r"model/embed\.weight.*c\.0\.0.*inner chunk 5"):
        ckpt.read_tensor("model.embed.weight", region=(slice(58, 62),))


def test_inner_chunks_back_to_back_in_a_shard_are_read_with_one_request(saved, monkeypatch):
    """Rows 10..59 of embed.weight span inner chunks 0..4 (12 rows each) of one shard: one ranged read of the shard
    (each inner chunk still checked by its own crc32c), after the index; on an object store each read is a round
    trip."""
    calls = []
    original = OpenFile.read_range_into
    monkeypatch.setattr(OpenFile, "read_range_into",
                        lambda self, start, buffers: calls.append(self.key) or original(self, start, buffers))
    ckpt = open_checkpoint(saved[0])

    rows = ckpt.read_tensor("model.embed.weight", region=(slice(10, 59), slice(3, 40)))

    assert torch.equal(rows, saved[1]["model"]["embed.weight"][10:59, 3:40])
    assert calls == ["model/embed.weight/c.0.0"], calls


def test_a_shards_index_and_its_inner_chunks_are_read_through_one_open_file(saved, monkeypatch):
    """The index, then the run of inner chunks: one open of the shard file, not one per read (a load of 800 arrays
    opened each shard twice)."""
    opened = []
    original = LocalStorage._open_for_reading
    monkeypatch.setattr(LocalStorage, "_open_for_reading",
                        lambda self, key: opened.append(key) or original(self, key))
    ckpt = open_checkpoint(saved[0])
    opened.clear()

    rows = ckpt.read_tensor("model.embed.weight", region=(slice(10, 59), slice(3, 40)))

    assert torch.equal(rows, saved[1]["model"]["embed.weight"][10:59, 3:40])
    assert opened.count("model/embed.weight/c.0.0") == 1, opened


def test_regions_follow_basic_indexing(saved):
    ckpt = open_checkpoint(saved[0])
    full = saved[1]["model"]["embed.weight"]

    assert torch.equal(ckpt.read_tensor("model.embed.weight", region=(5,)), full[5])
    assert torch.equal(ckpt.read_tensor("model.embed.weight", region=(-1, slice(None, 4))), full[-1, :4])
    assert torch.equal(ckpt.read_tensor("model.embed.weight", region=(..., 7)), full[..., 7])
    assert ckpt.read_tensor("model.embed.weight", region=(slice(90, 200),)).shape == (6, 256)
    with pytest.raises(IndexError, match="step 1"):
        ckpt.read_tensor("model.embed.weight", region=(slice(0, 10, 2),))
    with pytest.raises(IndexError, match="out of range"):
        ckpt.read_tensor("model.embed.weight", region=(96,))


def test_load_full_state_dict_rebuilds_the_nested_state_with_exact_values(saved):
    path, state = saved
    loaded = open_checkpoint(path).load_full_state_dict()

    state["trainer"]["ids"] = {"1": "a"}  # DCP flattens dict keys to strings, as dcp.load gives them back too
    assert_state_equal(loaded, state)
    assert type(loaded["optim"]["param_groups"]) is list
    assert loaded["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_load_full_state_dict_can_load_one_group(saved):
    loaded = open_checkpoint(saved[0]).load_full_state_dict(prefix=("model",))

    assert list(loaded) == ["model"] and sorted(loaded["model"]) == sorted(saved[1]["model"])


def test_an_unknown_name_suggests_close_names_or_the_wrapper_prefix(saved):
    ckpt = open_checkpoint(saved[0])

    with pytest.raises(KeyError, match=r"did you mean 'model\.embed\.weight'"):
        ckpt.read_tensor("model.embed.weights")
    with pytest.raises(KeyError, match=r"'_orig_mod\.' \(added by torch\.compile\)"):
        ckpt.read_tensor("model._orig_mod.embed.weight")
    with pytest.raises(TypeError, match="not a tensor"):
        ckpt.read_tensor("trainer.epoch")
    assert ckpt.read_value("trainer.epoch") == 3


def test_paths_that_are_not_checkpoints_are_refused_with_what_they_are(tmp_path, copy_of):
    with pytest.raises(NotACheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nowhere")
    zarr.open_group(tmp_path / "plain.zarr", mode="w").create_array("x", shape=(2,), dtype="f4")
    with pytest.raises(NotACheckpointError, match="not a dcp_zarr checkpoint"):
        open_checkpoint(tmp_path / "plain.zarr")
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "dcp"))
    with pytest.raises(NotACheckpointError, match="torch.distributed.checkpoint directory.*dcp-zarr convert"):
        open_checkpoint(tmp_path / "dcp")
    broken = copy_of()
    os.remove(broken / "zarr.json")
    with pytest.raises(IncompleteCheckpointError, match="incomplete"):
        open_checkpoint(broken)


def test_a_missing_chunk_is_reported_with_its_array_and_key(copy_of):
    path = copy_of()
    os.remove(path / "model" / "mask" / "c.0.0")

    with pytest.raises(CorruptChunkError, match=r"model/mask.*c\.0\.0.*missing"):
        open_checkpoint(path).read_tensor("model.mask")


@dataclass
class RunInfo:
    name: str


def test_objects_load_only_with_weights_only_unless_their_types_are_allowed(tmp_path):
    path = tmp_path / "objects.zarr"
    with pytest.warns(UntrustedTypeWarning, match="RunInfo"):  # said at save time, while the run can change it
        dcp.save({"extra": {"run": RunInfo("alpha")}}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path))
    ckpt = open_checkpoint(path)
    assert ckpt.entries["extra.run"].kind == "object"

    with pytest.raises(UntrustedTypeError, match="RunInfo.*safe_globals"):
        ckpt.read_value("extra.run")
    assert open_checkpoint(path, safe_globals=[RunInfo]).read_value("extra.run") == RunInfo("alpha")


# -- a multi-rank save, read back without any process group ---------------------------------------------------------


def _train_and_save(rank, world_size, layout, path):
    return train_and_save(rank, world_size, layout, ZarrWriter(path))[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_4_rank_fsdp_tp_checkpoint_loads_unsharded_offline_bit_exact(tmp_path):
    path = tmp_path / "fsdp_tp.zarr"
    saved = run_ranks(_train_and_save, 4, "fsdp_tp", str(path))[0]

    ckpt = open_checkpoint(path)
    loaded = ckpt.load_full_state_dict()

    assert_state_equal(loaded, saved)
    assert ckpt.saved_world_size == 4 and ckpt.state_dict_type == "sharded"
    assert {"shape": [2, 2], "dim_names": ["dp", "tp"]} in ckpt.meshes
    up = ckpt.entries["model.ffn.up.weight"]
    assert up.source["type"] == "dtensor" and up.saved_shards == 4
    # A slice across the saved shard boundaries (rows 5, 9, 14 of 18) reads back exactly.
    assert torch.equal(ckpt.read_tensor(up, region=(slice(4, 15),)), saved["model"]["ffn.up.weight"][4:15])
