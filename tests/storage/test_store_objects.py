"""Zarr store objects instead of a path or URL: ``ZarrWriter(store=...)``, ``ZarrReader(store=...)``,
``open_checkpoint(store=...)``. obstore's S3Store against the loopback S3 server (real ranks, gloo), zarr's
MemoryStore, FsspecStore and LocalStore in one process, and the errors for giving both or neither."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from zarr.storage import FsspecStore, LocalStore, MemoryStore, ObjectStore

from dcp_zarr import CheckpointExistsError, ZarrReader, ZarrSavePlanner, ZarrWriter, open_checkpoint
from dcp_zarr.tools.verify import verify_checkpoint
from tests.support.compare import assert_state_equal
from tests.support.faults import causes
from tests.support.models import load_fresh, train_and_save
from tests.support.ranks import run_ranks
from tests.support.s3 import CREDENTIALS

obstore_s3 = pytest.importorskip("obstore.store")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def s3_store(endpoint: str, bucket: str, prefix: str) -> ObjectStore:
    """obstore's S3 client, built in whichever process uses it (each rank its own: stores never travel in plans)."""
    return ObjectStore(obstore_s3.S3Store(bucket, prefix=prefix, endpoint=endpoint, region="us-east-1",
                                          access_key_id=CREDENTIALS["key"], secret_access_key=CREDENTIALS["secret"],
                                          client_options={"allow_http": True}))


def _save_rank(rank, world_size, endpoint, bucket, prefix):
    return train_and_save(rank, world_size, "fsdp2", ZarrWriter(store=s3_store(endpoint, bucket, prefix)))[0]


def _load_rank(rank, world_size, endpoint, bucket, prefix):
    return load_fresh(rank, world_size, "fsdp2", ZarrReader(store=s3_store(endpoint, bucket, prefix)))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
def test_two_ranks_save_through_obstore_and_three_ranks_load_it_resharded(s3):
    prefix = f"fsdp2-{uuid.uuid4().hex[:8]}.zarr"

    saved = run_ranks(_save_rank, 2, s3.endpoint, s3.bucket, prefix)[0]
    loaded = run_ranks(_load_rank, 3, s3.endpoint, s3.bucket, prefix)[0]

    assert_state_equal(loaded, saved)
    # Written in place (no staging prefix beside it) and readable through the URL path (s3fs) as well
    listing = s3.filesystem().ls(s3.bucket)
    assert f"{s3.bucket}/{prefix}" in listing and not [p for p in listing if "partial" in p], listing
    ckpt = open_checkpoint(f"s3://{s3.bucket}/{prefix}", s3.storage_options())
    assert ckpt.saved_world_size == 2
    assert_state_equal(ckpt.load_full_state_dict(), saved)
    assert verify_checkpoint(ckpt).ok
    assert_state_equal(open_checkpoint(store=s3_store(s3.endpoint, s3.bucket, prefix)).load_full_state_dict(), saved)


@pytest.mark.s3
def test_a_store_object_is_replaced_only_with_overwrite(s3):
    prefix = f"exists-{uuid.uuid4().hex[:8]}.zarr"
    dcp.save({"w": torch.ones(3)}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(store=s3_store(s3.endpoint, s3.bucket, prefix)))

    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.zeros(3)}, planner=ZarrSavePlanner(),
                 storage_writer=ZarrWriter(store=s3_store(s3.endpoint, s3.bucket, prefix)))
    assert isinstance(causes(info.value)[0], CheckpointExistsError), info.value
    assert "overwrite=True" in str(causes(info.value)[0])
    assert torch.equal(open_checkpoint(store=s3_store(s3.endpoint, s3.bucket, prefix)).read_tensor("w"), torch.ones(3))

    store = s3_store(s3.endpoint, s3.bucket, prefix)
    dcp.save({"w": torch.zeros(3)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(store=store, overwrite=True))
    assert torch.equal(open_checkpoint(store=s3_store(s3.endpoint, s3.bucket, prefix)).read_tensor("w"), torch.zeros(3))


STATE = {"model": {"w": torch.randn(7, 3), "b": torch.randn(3).to(torch.bfloat16)}, "step": 4, "tags": {"a", "b"}}


def _blank():
    return {"model": {"w": torch.zeros(7, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0, "tags": None}


def _memory_fsspec():
    return FsspecStore.from_url(f"memory://dcp-zarr-{uuid.uuid4().hex[:8]}.zarr")


def _obstore_memory():
    return ObjectStore(obstore_s3.MemoryStore())


@pytest.mark.parametrize("make", [MemoryStore, _memory_fsspec, _obstore_memory], ids=["memory", "fsspec", "obstore"])
def test_a_store_object_in_one_process_round_trips(make):
    store = make()
    dcp.save(STATE, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(store=store))

    loaded = _blank()
    dcp.load(loaded, storage_reader=ZarrReader(store=store))
    assert_state_equal(loaded, STATE)
    assert_state_equal(open_checkpoint(store=store).load_full_state_dict(), STATE)
    group = zarr.open_group(store, mode="r")  # a plain zarr store, as zarr-python reads it
    assert torch.equal(torch.from_numpy(group["model/w"][...]), STATE["model"]["w"])


def test_a_local_store_takes_the_local_fast_path(tmp_path):
    store = LocalStore(tmp_path / "ckpt.zarr")
    writer = ZarrWriter(store=store)
    assert writer.store is None and writer.path == str(tmp_path / "ckpt.zarr")  # a directory path, renamed into place
    dcp.save(STATE, planner=ZarrSavePlanner(), storage_writer=writer)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.zarr"]  # the staging directory was renamed
    assert_state_equal(open_checkpoint(tmp_path / "ckpt.zarr").load_full_state_dict(), STATE)
    loaded = _blank()
    dcp.load(loaded, storage_reader=ZarrReader(store=LocalStore(tmp_path / "ckpt.zarr", read_only=True)))
    assert_state_equal(loaded, STATE)


def test_path_and_store_together_or_neither_is_refused(tmp_path):
    store = MemoryStore()
    for make in (ZarrWriter, ZarrReader):
        with pytest.raises(ValueError, match=r"either path .* or store="):
            make(str(tmp_path / "x.zarr"), store=store)
    with pytest.raises(ValueError, match=r"either path .* or store="):
        open_checkpoint(tmp_path / "x.zarr", store=store)
    with pytest.raises(ValueError, match=r"needs a path or a store: pass path or store="):
        open_checkpoint()
    # A writer or reader without either may still get its path from dcp's checkpoint_id=; without that, it fails
    with pytest.raises(BaseException, match=r"needs a path or a store: pass path or store=, or checkpoint_id="):
        dcp.save({"w": torch.ones(2)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter())
    with pytest.raises(BaseException, match=r"needs a path or a store: pass path or store=, or checkpoint_id="):
        dcp.load({"w": torch.ones(2)}, storage_reader=ZarrReader())
    with pytest.raises(ValueError, match=r"store=.*checkpoint_id="):
        dcp.save({"w": torch.ones(2)}, planner=ZarrSavePlanner(),
                 storage_writer=ZarrWriter(store=store), checkpoint_id=str(tmp_path / "y"))


def test_a_store_that_is_not_one_or_is_read_only_is_refused_by_name():
    with pytest.raises(TypeError, match=r"store= must be a zarr store .* got dict"):
        ZarrWriter(store={})
    with pytest.raises(ValueError, match=r"read-only"):
        ZarrWriter(store=MemoryStore(read_only=True))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_store_holding_other_data_is_refused_and_the_data_kept(overwrite):
    """A store rooted at a whole bucket (the usual obstore idiom) must not lose the bucket's other data to a save."""
    store = MemoryStore()
    buffer = zarr.core.buffer.default_buffer_prototype().buffer.from_bytes(b"PAR1...")
    zarr.core.sync.sync(store.set("datasets/train.parquet", buffer))

    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.ones(3)}, planner=ZarrSavePlanner(),
                 storage_writer=ZarrWriter(store=store, overwrite=overwrite))
    cause = causes(info.value)[0]
    assert isinstance(cause, CheckpointExistsError) and "'datasets/train.parquet'" in str(cause), repr(cause)
    assert zarr.core.sync.sync(store.exists("datasets/train.parquet"))


def test_the_leftovers_of_an_interrupted_save_are_cleared_before_a_save():
    store = MemoryStore()
    prototype = zarr.core.buffer.default_buffer_prototype()
    for key in ("model/zarr.json", "model/w/zarr.json", "model/w/c.0.0", "optim/state/w/step/c", "legacy/w/c/0/1"):
        zarr.core.sync.sync(store.set(key, prototype.buffer.from_bytes(b"{}")))

    dcp.save({"w": torch.ones(3)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(store=store))

    assert not zarr.core.sync.sync(store.exists("legacy/w/c/0/1"))
    assert open_checkpoint(store=store).read_tensor("w").tolist() == [1.0, 1.0, 1.0]
