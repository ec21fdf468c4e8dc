"""Single-process save and load: every dtype, edge-case tensors, non-tensor values, paths, and bad input."""

from __future__ import annotations

import datetime
import decimal
import fractions
import io
import json
import os
import pathlib
import time
import uuid
import warnings
import weakref

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import (
    CheckpointExistsError,
    CorruptChunkError,
    InvalidKeyError,
    MalformedMetadataError,
    UntrustedTypeError,
    UntrustedTypeWarning,
    ZarrReader,
    ZarrSavePlanner,
    ZarrWriter,
)
from dcp_zarr.format.torch_arrays import numpy_as_tensor
from dcp_zarr.staging.pool import SAVE_THREAD_EXIT_GRACE_S, pinned_staging, tensor_devices
from dcp_zarr.storage.local import LocalStorage
from dcp_zarr.store_io import commit
from dcp_zarr.store_io.entry_data import tensor_reader
from tests.support.compare import assert_state_equal
from tests.support.states import DTYPES, random_bits
from tests.support.stores import root_copies

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")



def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def save(sd, path, **kwargs):
    dcp.save(sd, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path, **kwargs))


def load(sd, path, **kwargs):
    dcp.load(sd, storage_reader=ZarrReader(path, **kwargs))
    return sd


def blank_like(sd):
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: blank_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [blank_like(v) for v in sd]
    return None


def test_every_dtype_round_trips_bit_exact_and_zarr_sees_numbers(tmp_path):
    sd = {"t": {str(dtype).removeprefix("torch."): random_bits((7, 3), dtype, i) for i, dtype in enumerate(DTYPES)}}
    path = str(tmp_path / "dtypes.zarr")
    save(sd, path)
    back = load(blank_like(sd), path)
    group = zarr.open_group(path, mode="r")
    for name, tensor in sd["t"].items():
        assert same_bits(back["t"][name], tensor), name
        stored = group["t"][name]
        assert stored.shape == (7, 3)
        assert same_bits(numpy_as_tensor(stored[...], tensor.dtype), tensor), name
    assert group["t"]["bfloat16"].metadata.data_type.to_json(zarr_format=3) == "bfloat16"


def test_edge_case_tensors(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sd = {
        "empty": torch.zeros(0, 5),
        "empty_inner": torch.zeros(3, 0, 2),
        "scalar": torch.tensor(3.5),
        "zero_step": torch.tensor(0.0),
        "zeros": torch.zeros(4, 4),
        "transposed": base.t(),
        "strided_view": base[1:5, ::3],
        "row_view": base[2],
    }
    path = str(tmp_path / "edge.zarr")
    save(sd, path)
    back = load(blank_like(sd), path)
    for name, tensor in sd.items():
        assert same_bits(back[name], tensor.contiguous()), name
    group = zarr.open_group(path, mode="r")
    assert group["row_view"].shape == (10,), "a view stores only its own elements"
    assert group["zero_step"][()] == 0.0 and group["scalar"][()] == 3.5
    # a one-element tensor is kept in its array's fill_value (format/fill_values.py), with no chunk; any other
    # all-zero chunk is stored, not skipped as zarr-python skips a chunk equal to its fill_value
    assert not any(os.path.exists(os.path.join(path, name, "c")) for name in ("zero_step", "scalar"))
    assert group["scalar"].metadata.fill_value == 3.5
    assert os.path.exists(os.path.join(path, "zeros", "c.0.0"))


def test_large_tensor_is_sharded_into_inner_chunks_and_reads_partially(tmp_path):
    big = torch.randn(4096, 300)
    path = str(tmp_path / "big.zarr")
    save({"w": big}, path, inner_chunk_bytes=256 << 10)
    array = zarr.open_group(path, mode="r")["w"]
    assert array.metadata.codecs[0].__class__.__name__ == "ShardingCodec"
    assert torch.equal(torch.from_numpy(array[...]), big)
    reader = ZarrReader(path)
    target = {"w": torch.zeros_like(big)}
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["w"], big)


def _region_reader(path: str, fqn: str):
    reader = ZarrReader(path)
    reader.read_metadata()
    return tensor_reader(LocalStorage(path), reader.manifest.entries[fqn], fqn)


def test_an_empty_region_of_a_shard_reads_nothing_even_when_the_shard_is_gone(tmp_path):
    path = str(tmp_path / "s.zarr")
    save({"w": torch.randn(1024, 8)}, path, inner_chunk_bytes=4 << 10)  # one shard of 128-row inner chunks
    region = _region_reader(path, "w")
    os.remove(os.path.join(path, "w", "c.0.0"))

    assert region.read_into([3, 0], np.empty((0, 8), np.float32)) == 0
    assert region.read_into([5, 2], np.empty((4, 0), np.float32)) == 0
    assert region.read_into([1024, 0], np.empty((0, 8), np.float32)) == 0


def test_a_region_starting_before_the_array_is_refused_not_read_from_its_end(tmp_path):
    path = str(tmp_path / "s.zarr")
    save({"w": torch.randn(1024, 8)}, path, inner_chunk_bytes=4 << 10)

    with pytest.raises(CorruptChunkError):
        _region_reader(path, "w").read_into([-1, 0], np.zeros((2, 8), np.float32))


def test_each_save_in_a_process_describes_its_own_arrays_in_zarr_json_and_the_roots_copy(tmp_path):
    """Array documents are encoded once a process per array spec (the writer's cache): saves of the same key with
    another shape, dtype or chunking each describe their own array, in its zarr.json and in the root's copy."""
    for i, (tensor, options) in enumerate([(torch.zeros(4, 2), {}), (torch.zeros(3, dtype=torch.bfloat16), {}),
                                           (torch.zeros(4096, 64), {}), (torch.zeros(4096, 64),
                                                                         {"inner_chunk_bytes": 64 << 10})]):
        path = str(tmp_path / f"s{i}.zarr")
        save({"w": tensor}, path, **options)
        with open(os.path.join(path, "w", "zarr.json")) as f:
            own = json.load(f)
        assert own == root_copies(path)["w"], i
        array = zarr.open_group(path, mode="r")["w"]
        assert array.shape == tuple(tensor.shape) and torch.equal(torch.from_numpy(array[...].astype("float32")),
                                                                  tensor.float()), i
        if options:
            assert own["codecs"][0]["configuration"]["chunk_shape"][0] == (64 << 10) // (64 * 4), own


def test_non_tensor_values_round_trip_exactly(tmp_path):
    sd = {
        "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": float("nan"), "foreach": None,
                                    "params": ["a.weight", "b"], "amsgrad": False}]},
        # DCP itself turns int dict keys of the state dict into strings (FileSystemWriter too); inside a leaf tuple
        # they are ours to keep.
        "sched": {"last_epoch": 7, "_step_count": 8, "milestones": ({3: 1, "__x": 2},)},
        "misc": {"name": "run-1", "inf": float("-inf"), "nested": [[1, (2, 3)], {"x": "four"}]},
        "tagged": {"set": {1, 2, 3}, "frozen": frozenset({"a"}), "blob": b"\x00\xff", "empty": b""},
        "obj": {"size": torch.Size([2, 3])},
    }
    path = str(tmp_path / "values.zarr")
    save(sd, path)
    back = load(blank_like(sd), path)
    assert_state_equal(back, sd)
    manifest = zarr.open_group(path, mode="r").attrs["dcp_zarr"]
    assert manifest["entries"]["optim.param_groups.0.betas"]["value"] == {"__tuple__": [0.9, 0.999]}
    assert manifest["entries"]["tagged.blob"]["value"] == {"__bytes__": "AP8="}
    assert manifest["entries"]["obj.size"]["kind"] == "object"


def test_bytesio_and_numpy_values_are_json_and_load_with_default_options(tmp_path):
    """What DCP's TrainState saves (a BytesIO) and numpy RNG state load with no safe_globals and no pickle."""
    rng = np.random.RandomState(7).get_state()
    sd = {"train": {"loader": io.BytesIO(b"\x00position=17\xff"), "np_rng": rng, "count": np.int64(12),
                    "weights": np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3), "flag": np.bool_(True),
                    "empty": np.zeros((0, 4), dtype="<c16")}}
    path = str(tmp_path / "values.zarr")
    save(sd, path)
    back = load(blank_like(sd), path)["train"]

    assert isinstance(back["loader"], io.BytesIO) and back["loader"].getvalue() == b"\x00position=17\xff"
    assert back["np_rng"][0] == "MT19937" and np.array_equal(back["np_rng"][1], rng[1])
    assert back["np_rng"][2:] == rng[2:]
    assert type(back["count"]) is np.int64 and back["count"] == 12
    assert back["weights"].dtype == np.float32 and np.array_equal(back["weights"], sd["train"]["weights"])
    assert back["weights"].flags.writeable
    assert type(back["flag"]) is np.bool_ and back["empty"].shape == (0, 4) and back["empty"].dtype == "<c16"
    entries = zarr.open_group(path, mode="r").attrs["dcp_zarr"]["entries"]
    assert all(entries[f"train.{k}"]["kind"] == "value" for k in ("loader", "np_rng", "count", "weights"))
    assert entries["train.loader"]["value"] == {"__bytesio__": "AHBvc2l0aW9uPTE3/w=="}


def test_large_blobs_and_arrays_stay_out_of_the_manifest_and_still_load_with_default_options(tmp_path):
    big = np.random.default_rng(3).permutation(100_000)  # 800 KB: kept out of the root zarr.json
    sd = {"state": {"perm": big, "blob": bytes(range(256)) * 400, "buffer": io.BytesIO(b"x" * 70_000),
                    "small": np.arange(4, dtype=np.float16), "wide": np.float64(2.5)}}
    path = str(tmp_path / "big.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntrustedTypeWarning)
        save(sd, path)
    back = load(blank_like(sd), path)["state"]

    assert np.array_equal(back["perm"], big) and back["perm"].dtype == big.dtype
    assert back["blob"] == sd["state"]["blob"] and back["buffer"].getvalue() == b"x" * 70_000
    entries = zarr.open_group(path, mode="r").attrs["dcp_zarr"]["entries"]
    assert [entries[f"state.{k}"]["kind"] for k in ("perm", "blob", "buffer", "small", "wide")] == \
        ["object", "object", "object", "value", "value"]
    assert os.path.getsize(os.path.join(path, "zarr.json")) < 20_000


def test_a_fraction_is_not_trusted_by_default_because_unpickling_one_can_cost_unbounded_time(tmp_path):
    with pytest.warns(UntrustedTypeWarning, match="fractions.Fraction"):
        save({"f": fractions.Fraction(1, 3)}, str(tmp_path / "f.zarr"))


def test_standard_library_values_load_with_default_options(tmp_path):
    """Types DCP's own reader brings back (it unpickles freely) that only build a value: trusted by default."""
    sd = {"meta": {"when": datetime.datetime(2026, 12, 1, 14, 0, tzinfo=datetime.UTC),
                   "took": datetime.timedelta(seconds=3.5), "lr": decimal.Decimal("0.001"),
                   "run": uuid.UUID(int=5), "out": pathlib.PurePosixPath("/ckpt/step-3"), "window": slice(2, 9, 3),
                   "epochs": range(0, 10, 2)}}
    path = str(tmp_path / "std.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntrustedTypeWarning)  # none of these needs safe_globals, so none warns
        save(sd, path)
    back = load(blank_like(sd), path)

    assert back == sd and type(back["meta"]["out"]) is pathlib.PurePosixPath


class RunConfig:
    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, RunConfig) and other.name == self.name


def test_a_value_needing_safe_globals_warns_at_save_and_fails_at_load_as_an_untrusted_type(tmp_path):
    path = str(tmp_path / "custom.zarr")
    with pytest.warns(UntrustedTypeWarning, match=r"'extra\.config'.*RunConfig.*safe_globals"):
        save({"extra": {"config": RunConfig("alpha")}, "x": torch.ones(2)}, path)

    with pytest.raises(CheckpointException) as info:
        load({"extra": {"config": None}, "x": torch.zeros(2)}, path)
    cause, _traceback = info.value.failures[0]
    assert isinstance(cause, UntrustedTypeError) and not isinstance(cause, MalformedMetadataError)
    assert "tests.save_load.test_save_load.RunConfig" in str(cause) and "safe_globals" in str(cause)
    back = load({"extra": {"config": None}, "x": torch.zeros(2)}, path, safe_globals=[RunConfig])
    assert back["extra"]["config"] == RunConfig("alpha")


def test_refusing_to_replace_a_checkpoint_says_what_dcp_says(tmp_path):
    path = str(tmp_path / "twice.zarr")
    save({"x": torch.ones(1)}, path)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        save({"x": torch.ones(1)}, path, overwrite=False)


def test_checkpoint_id_argument_selects_the_path(tmp_path):
    path = str(tmp_path / "by_id.zarr")
    dcp.save({"x": torch.ones(3)}, checkpoint_id=path, planner=ZarrSavePlanner(), storage_writer=ZarrWriter())
    back = {"x": torch.zeros(3)}
    dcp.load(back, checkpoint_id=path, storage_reader=ZarrReader())
    assert torch.equal(back["x"], torch.ones(3))


def test_memory_url(tmp_path):
    sd = {"x": torch.arange(10.0), "lr": 0.5}
    save(sd, "memory://dcp-zarr-test/ckpt.zarr")
    back = load({"x": torch.zeros(10), "lr": 0.0}, "memory://dcp-zarr-test/ckpt.zarr")
    assert_state_equal(back, sd)


def test_path_that_is_not_a_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointException) as info:
        load({"x": torch.zeros(1)}, str(tmp_path / "nothing-here"))
    assert "nothing-here" in str(info.value) and "not a dcp_zarr checkpoint" in str(info.value)
    zarr.open_group(str(tmp_path / "foreign.zarr"), mode="w")
    with pytest.raises(CheckpointException, match="foreign.zarr is a zarr store but not a dcp_zarr checkpoint"):
        load({"x": torch.zeros(1)}, str(tmp_path / "foreign.zarr"))


def test_incomplete_checkpoint_is_refused(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    save({"model": {"w": torch.ones(2)}}, path)
    os.remove(os.path.join(path, "zarr.json"))  # as if the commit never happened
    with pytest.raises(CheckpointException, match="incomplete"):
        load({"model": {"w": torch.zeros(2)}}, path)


def test_absent_key_is_named(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    save({"model": {"w": torch.ones(2)}}, path)
    with pytest.raises(CheckpointException, match="model.v"):
        load({"model": {"w": torch.zeros(2), "v": torch.zeros(2)}}, path)


@pytest.mark.parametrize("key", ["..", "a/b", "/abs", "__reserved", "zarr.json", "", "nul\x00"])
def test_keys_that_would_escape_the_store_are_rejected_before_writing(tmp_path, key):
    path = tmp_path / "bad.zarr"
    with pytest.raises(CheckpointException) as info:
        save({"model": {key: torch.ones(2)}}, str(path))
    assert isinstance(info.value.failures[0][0], InvalidKeyError)
    assert repr(key)[1:-1] in str(info.value) or key in str(info.value)
    assert not path.exists()
    assert not any(p.name.startswith(".bad.zarr") for p in tmp_path.iterdir()), "nothing was written"


def test_existing_checkpoint_is_kept_with_overwrite_false(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    save({"x": torch.ones(2)}, path)
    with pytest.raises(CheckpointException) as info:
        save({"x": torch.full((2,), 2.0)}, path, overwrite=False)
    assert isinstance(info.value.failures[0][0], CheckpointExistsError)
    assert torch.equal(load({"x": torch.zeros(2)}, path)["x"], torch.ones(2))
    save({"x": torch.full((3,), 2.0)}, path, overwrite=True)
    assert torch.equal(load({"x": torch.zeros(3)}, path)["x"], torch.full((3,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.zarr"], "no staging or replaced directories are left behind"


@pytest.mark.parametrize("planned", [True, False], ids=["ZarrSavePlanner", "DCP's planner"])
def test_a_local_checkpoint_is_replaced_by_default_once_the_new_one_is_complete(tmp_path, planned, monkeypatch):
    """overwrite=None (the default): a file system's checkpoint is replaced, as FileSystemWriter's is, so a job that
    resumes from an earlier step can save the next steps again; the old one stays until the new one is complete."""
    path = str(tmp_path / "ckpt.zarr")
    save({"x": torch.ones(2)}, path)
    seen_at_commit = []
    real_commit = commit.commit

    def commit_and_look(staging, target, replace=False):  # the old checkpoint is still whole when the commit starts
        seen_at_commit.append((replace, load({"x": torch.zeros(2)}, target)["x"].tolist()))
        real_commit(staging, target, replace)

    monkeypatch.setattr(commit, "commit", commit_and_look)
    planner = ZarrSavePlanner() if planned else None
    dcp.save({"x": torch.full((2,), 3.0)}, planner=planner, storage_writer=ZarrWriter(path))
    assert seen_at_commit == [(True, [1.0, 1.0])]
    assert torch.equal(load({"x": torch.zeros(2)}, path)["x"], torch.full((2,), 3.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.zarr"], "no staging or replaced directories are left behind"


def test_a_directory_of_other_files_is_never_replaced(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    (path / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointException, match="not a dcp_zarr checkpoint"):
        save({"x": torch.ones(2)}, str(path), overwrite=True)
    assert (path / "precious.txt").read_text() == "keep me"


def test_unsupported_dtype_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointException, match="float8_e4m3fnuz"):
        save({"x": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}, str(tmp_path / "x.zarr"))
    assert not (tmp_path / "x.zarr").exists()


def async_save_and_load(rank, world_size, path, executor):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(33, 7, generator=torch.Generator().manual_seed(0))
    sd = {"model": {"w": torch.randn(5, 3, generator=torch.Generator().manual_seed(1)),
                    "sharded": distribute_tensor(full, mesh, [Shard(0)])}, "step": 3}
    kind = AsyncCheckpointerType.THREAD if executor == "thread" else AsyncCheckpointerType.PROCESS
    assert list(tensor_devices(sd)) == ["cpu", "cpu"], "a DTensor counts by its local shard's device"
    # One writer for both saves: with the thread executor the second copies into the first's staging buffers; the
    # process executor takes each staged copy away, so there every save stages anew.
    writer = ZarrWriter(cache_staged_state_dict=True)
    expected = []
    for i in range(2):
        expected.append({"w": sd["model"]["w"].clone(), "sharded": full.clone()})
        future = dcp.async_save(sd, planner=ZarrSavePlanner(),
                                storage_writer=writer, checkpoint_id=f"{path}/{i}", async_checkpointer_type=kind)
        # The call returned: the save works from the staged copy, so training may change the tensors now.
        sd["model"]["w"].add_(1)
        sd["model"]["sharded"].to_local().add_(1)
        full.add_(1)
        future.result()
    for i, saved in enumerate(expected):
        back = load({"model": {"w": torch.zeros(5, 3), "sharded": torch.zeros(33, 7)}, "step": 0}, f"{path}/{i}")
        assert_state_equal(back, {"model": saved, "step": 3})
    writer.close()
    return True


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save(tmp_path, executor):
    from tests.support.ranks import run_ranks

    assert run_ranks(async_save_and_load, 2, str(tmp_path / f"{executor}.zarr"), executor) == [True, True]


class _RecordingWriter(ZarrWriter):
    """Notes where each staged copy lives (data pointers) and a weak reference to it, keeping nothing alive."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.staged = []

    def stage(self, state_dict):
        out = super().stage(state_dict)
        self.staged.append(([out["a"].data_ptr(), out["nested"]["b"].data_ptr()], weakref.ref(out["a"])))
        return out


def _two_async_saves(writer, tmp_path):
    sd = {"a": torch.arange(6.0), "nested": {"b": torch.ones(2, 2)}}
    for i in range(2):
        dcp.async_save(sd, planner=ZarrSavePlanner(),
                       storage_writer=writer, checkpoint_id=str(tmp_path / f"{i}.zarr")).result()
        assert_state_equal(load(blank_like(sd), tmp_path / f"{i}.zarr"), sd)
        sd["a"].add_(1)
    return writer.staged


def test_each_async_save_stages_into_new_buffers_freed_with_the_save(tmp_path):
    (first_pointers, first), (_, second) = _two_async_saves(_RecordingWriter(), tmp_path)
    assert first() is None and second() is None, "the writer keeps no staged copy after its save"
    assert first_pointers[0] != torch.arange(6.0).data_ptr()


def test_kept_staging_buffers_are_reused_by_the_next_save(tmp_path):
    writer = _RecordingWriter(cache_staged_state_dict=True)
    (first_pointers, _), (second_pointers, _) = _two_async_saves(writer, tmp_path)
    assert second_pointers == first_pointers, "the second save copied into the first one's buffers"
    writer.close()


def test_a_writer_pickled_with_a_pending_save_gives_its_buffers_away(tmp_path):
    import pickle

    sd = {"a": torch.arange(6.0), "nested": {"b": torch.ones(2, 2)}}
    writer = ZarrWriter(tmp_path / "x.zarr", cache_staged_state_dict=True)
    staged = writer.stage(sd)
    kept = staged["a"]  # the buffer outlives the staged dict, as in a worker process still writing from it
    pickle.loads(pickle.dumps(writer))  # what the process executor does with a staged save: the buffers go with it
    del staged
    assert writer.stage(sd)["a"].data_ptr() != kept.data_ptr(), "copied into buffers given away"


def test_a_copy_of_an_idle_writer_keeps_its_buffers(tmp_path):
    import copy

    sd = {"a": torch.arange(6.0), "nested": {"b": torch.ones(2, 2)}}
    writer = ZarrWriter(tmp_path / "x.zarr", cache_staged_state_dict=True)
    staged = writer.stage(sd)
    pointer = staged["a"].data_ptr()
    del staged  # its save is over
    copy.deepcopy(writer)
    assert writer.stage(sd)["a"].data_ptr() == pointer


def test_the_next_async_save_may_start_from_the_previous_ones_done_callback(tmp_path):
    sd = {"w": torch.arange(6.0)}
    writer = ZarrWriter(cache_staged_state_dict=True)
    chained = []
    first = dcp.async_save(sd, planner=ZarrSavePlanner(), storage_writer=writer, checkpoint_id=str(tmp_path / "0.zarr"))
    first.add_done_callback(lambda _: chained.append(
        dcp.async_save(sd, planner=ZarrSavePlanner(), storage_writer=writer, checkpoint_id=str(tmp_path / "1.zarr"))))
    first.result()
    deadline = time.monotonic() + 30
    while not chained and time.monotonic() < deadline:
        time.sleep(0.01)
    chained[0].result()
    assert torch.equal(load({"w": torch.zeros(6)}, tmp_path / "1.zarr")["w"], sd["w"])


class _SlowWriter(ZarrWriter):
    def write_data(self, plan, planner):
        time.sleep(3 * SAVE_THREAD_EXIT_GRACE_S)
        return super().write_data(plan, planner)


@pytest.mark.slow
@pytest.mark.parametrize("cache", [False, True])
def test_an_overlapping_async_save_on_one_writer_is_refused_and_the_first_survives(tmp_path, cache):
    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    writer = _SlowWriter(cache_staged_state_dict=cache)
    first = dcp.async_save(sd, planner=ZarrSavePlanner(), storage_writer=writer, checkpoint_id=str(tmp_path / "0.zarr"))
    sd["w"].add_(100)
    with pytest.raises(RuntimeError, match="still running|not started yet"):
        dcp.async_save(sd, planner=ZarrSavePlanner(), storage_writer=writer, checkpoint_id=str(tmp_path / "1.zarr"))
    first.result()
    assert torch.equal(load({"w": torch.zeros(3, 4)}, tmp_path / "0.zarr")["w"], torch.arange(12.0).reshape(3, 4))
    assert not (tmp_path / "1.zarr").exists()
    dcp.async_save(sd, planner=ZarrSavePlanner(),
                   storage_writer=writer, checkpoint_id=str(tmp_path / "1.zarr")).result()  # now it may
    assert torch.equal(load({"w": torch.zeros(3, 4)}, tmp_path / "1.zarr")["w"], sd["w"])


class _FailingWriter(ZarrWriter):
    fail = True

    def write_data(self, plan, planner):
        if self.fail:
            raise OSError(28, "No space left on device (injected)")
        return super().write_data(plan, planner)


@pytest.mark.parametrize("where", ["while writing", "before planning (the target exists)"])
def test_a_failed_async_save_does_not_block_the_next_one_on_the_same_writer(tmp_path, where):
    sd = {"w": torch.arange(6.0)}
    writer = _FailingWriter(cache_staged_state_dict=True, overwrite=False)
    target = tmp_path / "0.zarr"
    if where.startswith("before"):
        writer.fail = False
        save({"w": torch.zeros(6)}, target)
    failed = dcp.async_save(sd, planner=ZarrSavePlanner(), storage_writer=writer, checkpoint_id=str(target))
    with pytest.raises(CheckpointException, match="No space left|already"):
        failed.result()
    writer.fail = False  # the failed future (and its traceback, holding the staged copy) is still referenced
    dcp.async_save(sd, planner=ZarrSavePlanner(),
                   storage_writer=writer, checkpoint_id=str(tmp_path / "1.zarr")).result()
    assert torch.equal(load({"w": torch.zeros(6)}, tmp_path / "1.zarr")["w"], sd["w"])
    assert failed.exception() is not None


def test_only_cuda_tensors_are_staged_through_pinned_buffers():
    assert pinned_staging(["cuda", "cpu"], cuda_available=True)
    assert not pinned_staging(["cpu"], cuda_available=True), "pinning CPU-to-CPU copies gains nothing"
    assert not pinned_staging(["cuda"], cuda_available=False)
    assert list(tensor_devices({"a": [torch.zeros(1), {"b": torch.zeros(1, device="meta")}], "c": 3})) == [
        "cpu", "meta"]


def _store_files(path) -> dict[str, bytes]:
    root = str(path)
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            full = os.path.join(directory, name)
            files[os.path.relpath(full, root)] = open(full, "rb").read()
    return files


def test_device_tensors_copied_on_io_threads_give_the_same_store(tmp_path, monkeypatch):
    """Chunks of tensors not in host memory (CUDA) are copied on the IO threads, one job per chunk. With that path
    forced on for CPU tensors (where ``.to("cpu")`` copies nothing), the chunk regions, keys and bookkeeping must give
    the store, byte for byte, that the direct path writes."""
    import dcp_zarr.store_io.write_jobs as writer_module

    sd = {"big": torch.randn(4096, 300), "t": torch.randn(64, 48).t(), "bf16": torch.randn(37, 5).bfloat16(),
          "scalar": torch.tensor(2.5, dtype=torch.bfloat16), "empty": torch.zeros(0, 3), "obj": torch.Size([2]),
          "kept_in_fill": torch.tensor(2.5)}
    direct = ZarrWriter(tmp_path / "direct.zarr", inner_chunk_bytes=256 << 10)
    dcp.save(sd, planner=ZarrSavePlanner(), storage_writer=direct)
    monkeypatch.setattr(writer_module, "_on_host", lambda tensor: False)
    copied = []
    for name in ("_write_from_device", "_write_rows_from_device"):  # chunks, and runs of an array-spanning shard
        real_write = getattr(writer_module, name)
        monkeypatch.setattr(writer_module, name, lambda storage, key, *args, real_write=real_write: (
            copied.append(key), real_write(storage, key, *args)))
    deferred = ZarrWriter(tmp_path / "deferred.zarr", inner_chunk_bytes=256 << 10)
    dcp.save(sd, planner=ZarrSavePlanner(), storage_writer=deferred)
    assert sorted(deferred.written_keys) == sorted(direct.written_keys)
    files = {k.split("#")[0] for k in direct.written_keys}
    assert files == {"big/c.0.0", "t/c.0.0", "bf16/c.0.0", "scalar/c", "obj/c.0"}, files
    # big (5 MiB, one rank) is one shard spanning the array, written in 16 MiB runs of its 256 KiB inner chunks
    assert set(copied) == files - {"obj/c.0"}, "every tensor chunk is copied on an IO thread"
    a, b = _store_files(tmp_path / "direct.zarr"), _store_files(tmp_path / "deferred.zarr")
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == ["zarr.json"], "only the manifest (save id, time) may differ"
    assert_state_equal(load(blank_like(sd), tmp_path / "deferred.zarr"), sd)


def test_loading_a_file_names_it_as_a_file_not_a_checkpoint(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"w": torch.zeros(2)}, storage_reader=ZarrReader(tmp_path / "model.pt"), no_dist=True)
    assert f"{tmp_path / 'model.pt'} is a file, not a checkpoint directory" in str(raised.value)
