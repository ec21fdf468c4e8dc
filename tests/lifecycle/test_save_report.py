"""What a ``CheckpointManager`` save did (``manager.last_save``, a ``SaveReport``, and its log line): the chunks and
bytes written, linked and copied over every rank, checked against the files the save left on disk (or the objects on
the loopback S3 server), and the time ``save()`` held the caller."""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from dcp_zarr import CheckpointManager, Compression, SaveReport, ZarrWriter, open_checkpoint
from tests.support.ranks import run_ranks

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

LOGGER = "dcp_zarr.lifecycle.manager"
# What the 2-rank saves below exercise, besides each rank's own chunks: a shard both ranks fill at offsets (the
# trained array's rows, uncompressed on a local file system: it counts once), arrays aggregated onto one rank (the
# norm and the frozen array, whose pieces are under aggregate_below), compressed chunks, and an incremental save's
# hard links (the frozen array's block, aggregated).
OPTIONS = {
    "full": {"aggregate_below": 4096, "inner_chunk_bytes": 1024},
    "compressed": {"compression": Compression(min_bytes=0, min_ratio=0), "inner_chunk_bytes": 1024},
    "incremental": {"incremental": True, "aggregate_below": 4096, "inner_chunk_bytes": 1024},
}


def on_disk(store) -> dict[str, tuple[int, int]]:
    """(files, bytes) of the store's arrays (its zarr.json documents aside), "written" by its save, and "linked":
    hard links to an earlier store's files (as they are until a later save links them too)."""
    files = [path for path in Path(store).rglob("*") if path.is_file() and path.name != "zarr.json"]
    written = [f for f in files if f.stat().st_nlink == 1]
    linked = [f for f in files if f.stat().st_nlink > 1]
    return {"written": (len(written), sum(f.stat().st_size for f in written)),
            "linked": (len(linked), sum(f.stat().st_size for f in linked))}


def reused(store) -> dict | None:
    """What the store's manifest records of the chunks it reused (``dcp-zarr inspect`` shows it), if anything."""
    record = json.loads((Path(store) / "zarr.json").read_text())["attributes"]["dcp_zarr"].get("chunks") or {}
    return record.get("incremental_from")


# -- over every rank ------------------------------------------------------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _save_twice(rank: int, world_size: int, root: str, options: dict) -> tuple[list, list[str], list]:
    """Rank program: two managed saves of a state the ranks hold in row blocks (the frozen array the same in both),
    the second one async; each rank's ``last_save`` after each, what the manager logged on the rank, and (rank 0)
    what each save left on disk, looked at once it was complete."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(full: torch.Tensor):
        return distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)

    def state(step: int) -> dict:
        return {"model": {"frozen": sharded(torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)),
                          "trained": sharded(torch.full((96, 40), float(step))),
                          "norm": sharded(torch.full((6, 5), float(step)))},
                "note": b"x" * 100_000, "step": step}  # a value too large for the manifest: stored as one chunk

    lines = _Lines()
    logging.getLogger(LOGGER).addHandler(lines)
    logging.getLogger(LOGGER).setLevel(logging.INFO)
    reports, disk = [], []
    with CheckpointManager(root, **options) as manager:
        manager.save(1, state(1))
        reports.append(manager.last_save)
        disk.append(on_disk(manager.path(1)) if rank == 0 else None)
        manager.save(2, state(2), async_save=True)
        manager.wait()
        reports.append(manager.last_save)
        disk.append(on_disk(manager.path(2)) if rank == 0 else None)
    return reports, lines.lines, disk


@pytest.mark.distributed
@pytest.mark.parametrize("kind", list(OPTIONS))
def test_rank_0_reports_and_logs_the_chunks_and_bytes_every_rank_stored_as_the_files_show(tmp_path, kind):
    root = tmp_path / "run"
    (reports, lines, disk), (others, other_lines, _) = run_ranks(_save_twice, 2, str(root), OPTIONS[kind])
    assert others == [None, None] and other_lines == [], "the figures are rank 0's, where DCP gathers them"
    for step, report, files in zip((1, 2), reports, disk):
        assert isinstance(report, SaveReport)
        assert (report.step, report.path) == (step, str(root / f"step-0000000{step}.zarr"))
        assert (report.written_chunks, report.written_bytes) == files["written"], (kind, step)
        assert (report.linked_chunks, report.linked_bytes) == files["linked"], (kind, step)
        assert (report.copied_chunks, report.copied_bytes) == (0, 0)
        assert report.blocked_s > 0
    assert [line for line in lines if line.startswith("INFO")] == [f"INFO dcp_zarr: {r}" for r in reports]
    if kind == "incremental":
        origin = reused(root / "step-00000002.zarr")  # the second save: the frozen array's chunks linked
        assert reports[1].linked_chunks == origin["reused_chunks"] > 0
        assert reports[1].linked_bytes == origin["reused_bytes"]
        assert reports[1].written_chunks > 0  # the trained array, the norm, the note
    else:
        assert reports[0].written_chunks == reports[1].written_chunks > 3


def test_the_log_line_says_every_figure():
    report = SaveReport(7, "ckpts/step-00000007.zarr", 96, 105_381_888, 380, 1_288_490_189, 0, 0, 0.8415)
    assert str(report) == ("step 7 saved (ckpts/step-00000007.zarr): chunks written 96 (100.5 MiB), linked 380 "
                           "(1.2 GiB), copied 0 (0 B); save() held the caller 0.84 s")


# -- the time save() held the caller ---------------------------------------------------------------------------------


def state(step: int) -> dict:
    return {"w": torch.full((64, 16), float(step)), "meta": {"step": step}}


def test_an_async_saves_report_comes_once_it_is_complete_and_counts_only_what_save_held(tmp_path, monkeypatch, caplog):
    """The upload is held until save() has returned: the report waits for it, and its time is not the caller's."""
    release = threading.Event()
    finish = ZarrWriter.finish

    def held_finish(writer, metadata, results):  # the coordinator's commit, on DCP's background thread
        assert release.wait(30), "the test never released the upload"
        finish(writer, metadata, results)

    monkeypatch.setattr(ZarrWriter, "finish", held_finish)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with CheckpointManager(tmp_path) as manager:
        release.set()
        began = time.perf_counter()
        manager.save(1, state(1))  # synchronous: held for the whole save
        held = time.perf_counter() - began
        assert 0 < manager.last_save.blocked_s <= held
        first = manager.last_save

        release.clear()
        began = time.perf_counter()
        future = manager.save(2, state(2), async_save=True)
        held = time.perf_counter() - began
        assert not future.done() and manager.last_save is first, "not complete: no report of it yet"
        release.set()
        manager.wait()
        report = manager.last_save
    assert report.step == 2 and 0 < report.blocked_s <= held
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [f"dcp_zarr: {first}", f"dcp_zarr: {report}"]


def test_a_failed_save_leaves_the_last_report_as_it_was(tmp_path):
    with CheckpointManager(tmp_path, overwrite=False) as manager:
        manager.save(1, state(1))
        first = manager.last_save
        manager.save(1, state(1), async_save=True)  # step 1 exists and overwrite is off
        with pytest.raises(BaseException, match="Checkpoint already exists"):
            manager.wait()
        assert manager.last_save is first


# -- on an object store --------------------------------------------------------------------------------------------


@pytest.mark.s3
def test_on_an_object_store_reused_chunks_are_reported_copied_not_linked(s3, aws_environment):
    root = f"s3://{s3.bucket}/report"
    frozen = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    with CheckpointManager(root, storage_options=s3.storage_options(), incremental=True,
                           inner_chunk_bytes=1024) as manager:
        manager.save(1, {"frozen": frozen, "trained": torch.full((8, 4), 1.0)})
        first = manager.last_save
        manager.save(2, {"frozen": frozen, "trained": torch.full((8, 4), 2.0)})
        second = manager.last_save
        path = manager.path(2)
    origin = open_checkpoint(path, storage_options=s3.storage_options()).manifest.chunk_record["incremental_from"]
    assert second.copied_chunks == origin["reused_chunks"] == first.written_chunks - 1 > 0
    assert second.copied_bytes == origin["reused_bytes"] and second.written_chunks == 1
    assert (second.linked_chunks, second.linked_bytes) == (0, 0)
