"""The earlier checkpoint of an incremental save (``ZarrWriter(incremental_from=...)``): refused, naming why, before
anything is written; saved without a chunk record; changed or damaged since it was recorded (its chunks, and the blocks
of aggregated arrays); on another file system. Whatever it is, the new store is complete and exact on its own."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import Compression, ZarrWriter
from dcp_zarr.errors import IncrementalBaseError, IncrementalSaveWarning
from dcp_zarr.tools.cli import main
from tests.support.compare import assert_state_equal
from tests.support.faults import causes, shard_named
from tests.support.ranks import run_ranks
from tests.support.states import load_full, random_bits
from tests.support.stores import edit_root_manifest, file_identities, new_files, root_manifest, tree_digest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
OPTIONS = {"inner_chunk_bytes": 16 << 10}  # 32 rows of 128 float32 a chunk: 8 chunks a matrix


def state(step: int) -> dict:
    """A frozen matrix, a trained one whose first rows change at every step, and the step."""
    trained = random_bits((256, 128), torch.float32, 7)
    trained[: step + 1] += 1
    return {"model": {"frozen": random_bits((256, 128), torch.float32, 6), "trained": trained},
            "step": torch.tensor(step)}


def save(state_dict, path, **writer_options) -> ZarrWriter:
    writer = ZarrWriter(path, **OPTIONS, **writer_options)
    dcp.save(state_dict, storage_writer=writer, no_dist=True)
    return writer


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """An incremental save of ``state(1)``, its chunks recorded; tests that change it take a copy."""
    path = tmp_path_factory.mktemp("recorded") / "1.zarr"
    save(state(1), path, incremental=True)
    return path


# -- refused, before anything is written -------------------------------------------------------------------------------


def _refused(target, base, match: str, **writer_options) -> None:
    """The save of ``state(2)`` into ``target`` from ``base`` fails naming ``match``; every file stays as it was."""
    before = {place: tree_digest(place) if os.path.exists(place) else None for place in (target, base)}
    with pytest.raises(CheckpointException) as raised:
        save(state(2), target, incremental_from=base, **writer_options)
    [cause] = causes(raised.value)
    assert isinstance(cause, IncrementalBaseError) and match in str(cause), str(cause)
    assert {place: tree_digest(place) if os.path.exists(place) else None for place in (target, base)} == before


def _refused_by_the_writer(target, base, match: str) -> None:
    """A ``base`` no save into ``target`` can use whatever it holds is refused as the writer is made, naming
    ``match``, and again at the save when ``dcp.save``'s ``checkpoint_id`` gives the path; nothing is written."""
    before = {place: tree_digest(place) if os.path.exists(place) else None for place in (target, base)}
    with pytest.raises(IncrementalBaseError, match=match):
        ZarrWriter(target, incremental_from=base, **OPTIONS)
    writer = ZarrWriter(incremental_from=base, **OPTIONS)
    with pytest.raises(IncrementalBaseError, match=match):
        dcp.save(state(2), storage_writer=writer, checkpoint_id=target, no_dist=True)
    assert {place: tree_digest(place) if os.path.exists(place) else None for place in (target, base)} == before


def test_an_empty_directory_is_refused_as_no_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "2.zarr", tmp_path / "empty", "is not a complete checkpoint")
    assert not (tmp_path / "2.zarr").exists()


def test_a_file_is_refused_as_no_checkpoint(tmp_path):
    torch.save(state(1), tmp_path / "model.pt")
    _refused(tmp_path / "2.zarr", tmp_path / "model.pt", "is a file, not a checkpoint directory")
    assert not (tmp_path / "2.zarr").exists()


def test_an_interrupted_save_is_refused_as_incomplete(recorded, store_copy, tmp_path):
    interrupted = store_copy(recorded)
    os.remove(interrupted / "zarr.json")  # written last: a save that stopped before it
    _refused(tmp_path / "2.zarr", interrupted, "the save was interrupted")
    assert not (tmp_path / "2.zarr").exists()


def test_the_saves_own_path_is_refused_however_it_is_spelt(recorded, store_copy):
    own = store_copy(recorded)
    _refused_by_the_writer(own, own, "the save's own path")
    _refused_by_the_writer(own, f"{own.parent}/../{own.parent.name}/{own.name}/", "the save's own path")
    _refused_by_the_writer(own, f"file://{own.parent}/./{own.name}", "the save's own path")
    _refused_by_the_writer(f"file://{own}", f"file://{own.parent}/./{own.name}", "the save's own path")


def test_a_checkpoint_on_other_storage_is_refused(recorded, tmp_path):
    _refused_by_the_writer(tmp_path / "2.zarr", "memory://x", "is on other storage")
    assert not (tmp_path / "2.zarr").exists()


def _as_format(version: int):
    """A manifest edit: the store said to be of format ``version``, which keeps no tensor in a fill_value."""
    def edit(manifest: dict) -> None:
        manifest.update(format_version=version)
        for entry in manifest["entries"].values():
            entry.pop("fill", None)
    return edit


def test_a_checkpoint_of_another_format_version_is_refused(recorded, store_copy, tmp_path):
    older = store_copy(recorded)
    edit_root_manifest(older, _as_format(5))
    _refused(tmp_path / "2.zarr", older, "format version 5")
    assert not (tmp_path / "2.zarr").exists()


def test_a_format_6_checkpoint_is_a_base_its_chunks_laid_out_alike(recorded, store_copy, tmp_path):
    """Format 7 only keeps one-element tensors in their fill_value (the step here), which a save never reuses."""
    older = store_copy(recorded)
    edit_root_manifest(older, _as_format(6))
    writer = save(state(2), tmp_path / "2.zarr", incremental_from=older)
    assert writer.reuse_counts.linked_chunks > 0
    shutil.rmtree(older)
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), state(2)), state(2))


def test_incremental_false_with_incremental_from_is_refused_at_the_writer(recorded, tmp_path):
    with pytest.raises(ValueError, match="with incremental=False"):
        ZarrWriter(tmp_path / "2.zarr", incremental=False, incremental_from=recorded)
    assert not (tmp_path / "2.zarr").exists()


def test_a_store_object_with_incremental_from_is_refused(recorded):
    before, held = tree_digest(recorded), {}
    with pytest.raises(IncrementalBaseError, match="not store="):
        ZarrWriter(store=zarr.storage.MemoryStore(held), incremental_from=recorded, **OPTIONS)
    assert held == {} and tree_digest(recorded) == before


def _save_from(rank, world_size, target, base):
    try:
        dcp.save(state(2), storage_writer=ZarrWriter(target, incremental_from=base))
    except CheckpointException as exc:
        return [type(cause).__name__ for cause in causes(exc)]
    return None


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_refuses_a_bad_earlier_checkpoint_before_anything_is_written(tmp_path):
    (tmp_path / "empty").mkdir()
    refused = run_ranks(_save_from, 2, str(tmp_path / "2.zarr"), str(tmp_path / "empty"))

    assert refused == [["IncrementalBaseError"] * 2] * 2
    assert os.listdir(tmp_path) == ["empty"] and os.listdir(tmp_path / "empty") == []


# -- an earlier store without a record, or changed since ---------------------------------------------------------------


def test_an_earlier_store_without_a_record_warns_writes_everything_and_records_for_the_next(tmp_path):
    save(state(1), tmp_path / "1.zarr")  # a default, full save: no chunk record
    with pytest.warns(IncrementalSaveWarning, match="records no chunks"):
        second = save(state(2), tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr")

    assert second.reuse_counts.linked_chunks == 0
    assert new_files(tmp_path / "2.zarr", tmp_path / "1.zarr").keys() == file_identities(tmp_path / "2.zarr").keys()
    assert "chunks" in root_manifest(tmp_path / "2.zarr")
    third = save(state(3), tmp_path / "3.zarr", incremental_from=tmp_path / "2.zarr")
    assert third.reuse_counts.linked_chunks > 0
    shutil.rmtree(tmp_path / "1.zarr")
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), state(2)), state(2))
    shutil.rmtree(tmp_path / "2.zarr")
    assert_state_equal(load_full(str(tmp_path / "3.zarr"), state(3)), state(3))


def test_an_earlier_chunk_replaced_since_it_was_recorded_is_written_anew(recorded, store_copy, tmp_path):
    earlier = store_copy(recorded)
    victim = earlier / "model" / "frozen" / "c.3.0"
    donor = (earlier / "model" / "frozen" / "c.4.0").read_bytes()  # a valid chunk, the same size, other bytes
    assert len(donor) == victim.stat().st_size and donor != victim.read_bytes()
    (earlier / "replacement").write_bytes(donor)
    os.replace(earlier / "replacement", victim)

    second = save(state(2), tmp_path / "2.zarr", incremental_from=earlier)

    written = new_files(tmp_path / "2.zarr", earlier)
    assert "model/frozen/c.3.0" in written and "model/frozen/c.2.0" not in written
    assert second.reuse_counts.linked_chunks > 0
    shutil.rmtree(earlier)
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), state(2)), state(2))


def test_a_compressed_earlier_chunk_replaced_by_one_of_its_size_is_written_anew(tmp_path):
    # Chunk i holds i in every element: compressed, several chunks store as many bytes, and a shard's index (the
    # offsets and sizes of its inner chunks, and their crc32c) is then the same in each
    constant = {"w": torch.arange(8.0).repeat_interleave(32)[:, None].expand(256, 128).contiguous()}
    compressed = {"compression": Compression("zstd", min_bytes=0, min_ratio=0)}
    save(constant, tmp_path / "1.zarr", incremental=True, **compressed)
    chunks = sorted((tmp_path / "1.zarr" / "w").glob("c.*"))
    victim, donor = next((a, b) for a in chunks for b in chunks
                         if a != b and a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes())
    shutil.copyfile(donor, tmp_path / "replacement")
    os.replace(tmp_path / "replacement", victim)

    save(constant, tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr", **compressed)

    assert f"w/{victim.name}" in new_files(tmp_path / "2.zarr", tmp_path / "1.zarr")
    shutil.rmtree(tmp_path / "1.zarr")
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), constant), constant)


def test_an_earlier_chunk_deleted_since_it_was_recorded_is_written_anew(recorded, store_copy, tmp_path):
    earlier = store_copy(recorded)
    os.remove(earlier / "model" / "frozen" / "c.3.0")

    save(state(2), tmp_path / "2.zarr", incremental_from=earlier)

    written = new_files(tmp_path / "2.zarr", earlier)
    assert "model/frozen/c.3.0" in written and "model/frozen/c.2.0" not in written
    shutil.rmtree(earlier)
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), state(2)), state(2))


def aggregated_state(step: int) -> dict:
    """Three small matrices (the same pattern, offset: compressible), held in halves by two ranks, so aggregated: two
    frozen, one trained."""
    pattern = (torch.arange(64 * 64) % 13).float().reshape(64, 64)
    return {"model": {"frozen": pattern + 0.5, "victim": pattern + 1.5, "trained": pattern + 10 * step}}


AGGREGATED = dict.fromkeys(("frozen", "victim", "trained"), 0)


def _aggregated_chain(rank, world_size, root, options):
    """Save ``aggregated_state(1)``, replace the earlier ``victim`` block by ``trained``'s (a valid block of other
    bytes), then save ``aggregated_state(2)`` from it; the second save's counts."""
    import torch.distributed as dist

    first = f"{root}/1.zarr"
    dcp.save(shard_named(aggregated_state(1), world_size, AGGREGATED),
             storage_writer=ZarrWriter(first, incremental=True, **options))
    dist.barrier()
    if rank == 0:
        shutil.copyfile(f"{first}/model/trained/c.0.0", f"{root}/replacement")
        os.replace(f"{root}/replacement", f"{first}/model/victim/c.0.0")
    dist.barrier()
    writer = ZarrWriter(f"{root}/2.zarr", incremental_from=first, **options)
    dcp.save(shard_named(aggregated_state(2), world_size, AGGREGATED), storage_writer=writer)
    return writer.reuse_counts


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("options", [
    {},  # 16 KiB arrays, each one plain chunk
    {"inner_chunk_bytes": 4 << 10, "aggregate_below": 1 << 20},  # a shard of 4 inner chunks
    {"inner_chunk_bytes": 4 << 10, "aggregate_below": 1 << 20,
     "compression": Compression("zstd", min_bytes=0, min_ratio=0)},
], ids=["chunk", "shard", "compressed-shard"])
def test_an_aggregated_block_replaced_since_it_was_recorded_is_written_anew(tmp_path, options):
    """An aggregated block is linked when its holders' parts make the recorded digest, then checked against the
    record (a plain chunk's last bytes; a shard of several inner chunks by its index and their crc32c's): the replaced
    one is gathered and written from the state, the unchanged one stays linked."""
    counts = run_ranks(_aggregated_chain, 2, str(tmp_path), options)
    first, second = tmp_path / "1.zarr", tmp_path / "2.zarr"
    assert sorted(new_files(second, first)) == sorted(
        [f"model/{name}/c.0.0" for name in ("victim", "trained")]
        + [f for f in file_identities(second) if os.path.basename(f) == "zarr.json"])
    assert sum(c.linked_chunks for c in counts) == 1 and sum(c.written_chunks for c in counts) == 2
    shutil.rmtree(first)
    assert main(["verify", str(second)]) == 0
    assert_state_equal(load_full(str(second), aggregated_state(2)), aggregated_state(2))


# -- another file system -----------------------------------------------------------------------------------------------


def test_across_file_systems_the_chunks_are_copied_with_one_warning(tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is not a file system apart from tmp_path's here: no link across devices to try")
    earlier = tempfile.mkdtemp(prefix="dcp-zarr-incremental-", dir=shm)
    try:
        save(state(1), f"{earlier}/1.zarr", incremental=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = save(state(2), tmp_path / "2.zarr", incremental_from=f"{earlier}/1.zarr", thread_count=4)
    finally:
        shutil.rmtree(earlier)

    warned = [w for w in caught if issubclass(w.category, IncrementalSaveWarning)]
    assert len(warned) == 1 and "copied through this process" in str(warned[0].message)
    # each copied, one warning for all; counted as written, as their bytes passed through this process
    assert second.reuse_counts.linked_chunks == 0 and second.reuse_counts.written_chunks > 4
    assert all(os.stat(tmp_path / "2.zarr" / f).st_nlink == 1 for f in file_identities(tmp_path / "2.zarr"))
    assert main(["verify", str(tmp_path / "2.zarr")]) == 0
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), state(2)), state(2))
