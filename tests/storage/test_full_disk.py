"""A disk that fills up during a save: the save fails with an error naming the file, nothing is committed, and the
checkpoint already at the path (and any other) is intact.

Three ways to run out of space without a small tmpfs (not mountable here):

* ``os.pwritev`` wrapped with a byte budget: a short write, then ENOSPC, exactly as the kernel does, at many points;
* a real kernel limit: ``RLIMIT_FSIZE`` in one rank of a two-rank save (SIGXFSZ ignored, so writes fail with EFBIG);
* an fsspec memory filesystem that refuses writes past a budget, for the object-store path.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import signal
import warnings

import fsspec
import pytest
import torch.distributed.checkpoint as dcp
from fsspec.implementations.memory import MemoryFileSystem
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import MalformedMetadataError, NotACheckpointError, ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.storage import LocalStorage, open_storage
from dcp_zarr.storage import local as local_storage
from dcp_zarr.store_io.commit import STAGING_DIR, STAGING_MARK
from dcp_zarr.store_io.root_document import read_manifest
from tests.support.compare import assert_state_equal
from tests.support.faults import CRASH_WRITER_OPTIONS, causes, crash_state, sharded_state
from tests.support.ranks import Zygote
from tests.support.states import load_full, save_plain
from tests.support.stores import tree_digest

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

OLD, NEW = crash_state(1), crash_state(2)
WRITER = {"overwrite": True, "inner_chunk_bytes": 2048}


@pytest.fixture
def workspace(tmp_path):
    """A checkpoint at the target, and an earlier one beside it."""
    target, earlier = str(tmp_path / "ckpt.zarr"), str(tmp_path / "earlier.zarr")
    save_plain(OLD, target, **WRITER)
    save_plain(crash_state(3), earlier)
    return target, earlier, tree_digest(earlier)


def _assert_untouched(target: str, earlier: str, earlier_digest: dict) -> None:
    assert_state_equal(load_full(target, OLD), OLD)
    assert tree_digest(earlier) == earlier_digest
    staging_dir = os.path.join(os.path.dirname(target), STAGING_DIR)
    for name in os.listdir(staging_dir) if os.path.isdir(staging_dir) else []:
        if STAGING_MARK in name:  # what the failed save wrote so far: never taken for a checkpoint
            with pytest.raises((NotACheckpointError, MalformedMetadataError)):
                read_manifest(LocalStorage(os.path.join(staging_dir, name)))


class _Disk:
    """``os.pwritev`` (how dcp_zarr writes every file) against a disk with ``free`` bytes left: a short write when it
    fills, then ENOSPC."""

    def __init__(self, free: int | None):
        self.free = free
        self.written = 0
        self._real = os.pwritev

    def pwritev(self, fd, buffers, offset):
        wanted = sum(len(memoryview(b).cast("B")) for b in buffers)
        if self.free is None or self.written + wanted <= self.free:
            n = self._real(fd, buffers, offset)
            self.written += n
            return n
        room = self.free - self.written
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:room]
        n = os.pwrite(fd, data, offset)
        self.written += n
        return n


def _measure_save_bytes(tmp_path, monkeypatch) -> int:
    disk = _Disk(None)
    monkeypatch.setattr(os, "pwritev", disk.pwritev)
    save_plain(NEW, str(tmp_path / "measure.zarr"), **WRITER)
    monkeypatch.undo()
    return disk.written


def test_enospc_at_any_point_fails_the_save_and_keeps_the_previous_checkpoint(workspace, tmp_path, monkeypatch):
    target, earlier, earlier_digest = workspace
    (tmp_path / "m").mkdir()
    total = _measure_save_bytes(tmp_path / "m", monkeypatch)
    rng = random.Random(20260603)
    budgets = sorted({0, 1, total - 1, total // 2, *(rng.randrange(total) for _ in range(30))})
    for free in budgets:
        disk = _Disk(free)
        monkeypatch.setattr(os, "pwritev", disk.pwritev)
        with pytest.raises(CheckpointException) as info:
            save_plain(NEW, target, **WRITER)
        monkeypatch.undo()
        cause = causes(info.value)[0]
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, f"free={free}: {cause!r}"
        assert cause.filename and STAGING_MARK in cause.filename, f"free={free}: the error names no file: {cause}"
        _assert_untouched(target, earlier, earlier_digest)
    print(f"\nfull disk: {len(budgets)} budgets from 0 to {total - 1} of the {total} bytes a save writes: "
          "every save failed with ENOSPC naming its file; the previous checkpoint loaded bit-exact each time")
    save_plain(NEW, target, **WRITER)  # space again: the same save goes through, over the leftovers
    assert_state_equal(load_full(target, NEW), NEW)


def test_a_sync_that_reports_a_write_back_error_fails_the_save(workspace, monkeypatch):
    """ENOSPC or EIO can surface only at sync time (NFS, delayed allocation): the save must not commit then."""
    target, earlier, earlier_digest = workspace

    class _Libc:
        def __init__(self, *args, **kwargs):
            pass

        @staticmethod
        def syncfs(fd):
            import ctypes

            ctypes.set_errno(errno.ENOSPC)
            return -1

    monkeypatch.setattr(local_storage.ctypes, "CDLL", _Libc)
    with pytest.raises(CheckpointException) as info:
        save_plain(NEW, target, **WRITER)
    monkeypatch.undo()
    cause = causes(info.value)[0]
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
    _assert_untouched(target, earlier, earlier_digest)


# -- a real kernel limit, in one rank of two ---------------------------------------------------------------------------


def save_with_file_size_limit(rank: int, world_size: int, report, target: str, limited_rank: int, limit: int):
    if rank == limited_rank:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel then fails the write with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    dcp.save(sharded_state(2, world_size), planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(target, **CRASH_WRITER_OPTIONS))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("limited_rank", [0, 1])
def test_a_rank_hitting_the_file_size_limit_fails_the_save_on_every_rank(workspace, limited_rank):
    target, earlier, earlier_digest = workspace
    zygote = Zygote()
    try:
        outcomes = zygote.launch(save_with_file_size_limit, 2, target, limited_rank, 4096).wait(60)
    finally:
        zygote.close()
    assert all(kind == "raised" for kind, _ in outcomes.values()), outcomes
    assert "File too large" in outcomes[limited_rank][1] and STAGING_MARK in outcomes[limited_rank][1]
    _assert_untouched(target, earlier, earlier_digest)


# -- an object store that is full --------------------------------------------------------------------------------------


class _FullMemoryFileSystem(MemoryFileSystem):
    """memory:// with a quota: a put that would pass ``quota`` bytes fails with ENOSPC (as a full bucket or quota)."""

    protocol = "fullmem"
    store: dict = {}
    pseudo_dirs = [""]
    quota: int | None = None
    used = 0

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        cls = type(self)
        if cls.quota is not None and cls.used + len(value) > cls.quota:
            raise OSError(errno.ENOSPC, "quota exceeded", path)
        cls.used += len(value)
        return super().pipe_file(path, value, mode=mode, **kwargs)


def test_an_object_store_that_fills_up_fails_the_save_with_no_commit(monkeypatch):
    fsspec.register_implementation("fullmem", _FullMemoryFileSystem, clobber=True)
    monkeypatch.setattr(_FullMemoryFileSystem, "store", {})
    url, other = "fullmem://bucket/ckpt.zarr", "fullmem://bucket/other.zarr"
    save_plain(crash_state(3), other)
    other_keys = sorted(k for k in _FullMemoryFileSystem.store if "other.zarr" in k)
    monkeypatch.setattr(_FullMemoryFileSystem, "used", 0)
    save_plain(NEW, "fullmem://bucket/measure.zarr", **WRITER)
    total = _FullMemoryFileSystem.used
    for quota in (0, total // 10, total // 2, total - 1):
        monkeypatch.setattr(_FullMemoryFileSystem, "used", 0)
        monkeypatch.setattr(_FullMemoryFileSystem, "quota", quota)
        with pytest.raises(CheckpointException) as info:
            save_plain(NEW, url, **WRITER)
        cause = causes(info.value)[0]
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
        assert "not retried" in str(cause) and "ckpt.zarr" in str(cause), str(cause)
        assert not open_storage(url).exists("zarr.json"), f"quota {quota}: committed"
        with pytest.raises(CheckpointException, match="not a dcp_zarr checkpoint|incomplete"):
            dcp.load({"optim": {"lr": None}}, storage_reader=ZarrReader(url))
        assert sorted(k for k in _FullMemoryFileSystem.store if "other.zarr" in k) == other_keys
    monkeypatch.setattr(_FullMemoryFileSystem, "quota", None)
    save_plain(NEW, url, **WRITER)
    assert_state_equal(load_full(url, NEW), NEW)
