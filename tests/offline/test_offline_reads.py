"""The offline API reads as ZarrReader does: regions in row pieces (``RegionReader.read_jobs``) on the same scheduler,
within the storage's requests and bytes in flight, and every read exact."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import ZarrSavePlanner, ZarrWriter
from dcp_zarr.offline import Checkpoint, open_checkpoint
from dcp_zarr.storage.base import StoredValue
from dcp_zarr.storage.local import LocalStorage
from dcp_zarr.store_io.chunks import READ_PIECE_BYTES
from dcp_zarr.store_io.root_document import read_manifest
from tests.support.compare import assert_state_equal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Inner chunks of about 256 KiB: a piece of READ_PIECE_BYTES holds many, and a region may start or end inside one.
INNER_BYTES = 256 * 1024
MIB = 1 << 20


def sample_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {
            "big": torch.randn(2600, 1024, generator=g),  # 10.2 MiB: 3 row pieces
            **{f"mid{i}": torch.randn(640, 1024, generator=g) for i in range(4)},  # 2.5 MiB each: 1 piece each
            "scale": torch.tensor(0.25),  # kept in its array's fill_value: no chunk
            "half_scale": torch.tensor(0.25, dtype=torch.bfloat16),  # a dtype that is not: one chunk
            "empty": torch.empty(0, 5),
            "bias": torch.randn(3, generator=g).to(torch.bfloat16),
        },
        "trainer": {"epoch": 4},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("offline_reads") / "ckpt.zarr"
    dcp.save(sample_state(), planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path, inner_chunk_bytes=INNER_BYTES))
    return path, sample_state()


class CountingStorage(LocalStorage):
    """A local store with limits of its own (an object store's, smaller) that counts the reads in flight at once
    and the bytes they ask for; each read is slowed a little so that reads allowed to overlap do."""

    def __init__(self, root, *, requests: int, max_bytes: int | None = None):
        super().__init__(str(root))
        self.requests = requests
        self.max_bytes_in_flight = max_bytes
        self.batch_bytes = 0  # every job on its own, as on an object store: the limits alone bound the overlap
        self.lock = threading.Lock()
        self.reads = self.peak_reads = self.bytes = self.peak_bytes = 0
        self.ranges: list[tuple[str, int]] = []  # (key, start) of each chunk read

    def requests_in_flight(self, thread_count: int) -> int:
        return self.requests

    def open_value(self, key: str) -> StoredValue:
        return _CountedValue(self, key, super().open_value(key))

    def count(self, key: str, start: int | None, nbytes: int, read):
        with self.lock:
            self.reads += 1
            self.bytes += nbytes
            self.peak_reads, self.peak_bytes = max(self.peak_reads, self.reads), max(self.peak_bytes, self.bytes)
            if start is not None:
                self.ranges.append((key, start))
        try:
            time.sleep(0.005)
            return read()
        finally:
            with self.lock:
                self.reads -= 1
                self.bytes -= nbytes


class _CountedValue(StoredValue):
    def __init__(self, storage: CountingStorage, key: str, opened: StoredValue):
        super().__init__(storage, key)
        self.counting, self.opened = storage, opened

    def read_range_into(self, start: int, buffers: list[memoryview]) -> int:
        return self.counting.count(self.key, start, sum(len(b) for b in buffers),
                                   lambda: self.opened.read_range_into(start, buffers))

    def read_tail(self, length: int) -> bytes:
        return self.counting.count(self.key, None, length, lambda: self.opened.read_tail(length))

    def close(self) -> None:
        self.opened.close()


def counting_checkpoint(path, **limits) -> tuple[Checkpoint, CountingStorage]:
    storage = CountingStorage(path, **limits)
    return Checkpoint(storage, read_manifest(storage), thread_count=8), storage


def read_beside_rows(pieces: int) -> int:
    """The most bytes ``pieces`` pieces read beside their rows: each inner chunk's crc32c (4 bytes; a piece holds
    fewer than 64 inner chunks of about INNER_BYTES)."""
    return pieces * 64 * 4


# -- the limits ------------------------------------------------------------------------------------------------------

def test_a_tensor_is_read_with_no_more_requests_at_once_than_the_storage_keeps_in_flight(saved):
    ckpt, storage = counting_checkpoint(saved[0], requests=2)

    big = ckpt.read_tensor("model.big")

    assert torch.equal(big, saved[1]["model"]["big"])
    assert storage.peak_reads == 2  # its pieces overlap, two at a time, though the checkpoint asks for 8 threads


def test_a_tensor_is_read_within_the_storages_bytes_in_flight(saved):
    ckpt, storage = counting_checkpoint(saved[0], requests=8, max_bytes=READ_PIECE_BYTES)

    big = ckpt.read_tensor("model.big")

    assert torch.equal(big, saved[1]["model"]["big"])
    assert storage.peak_reads == 1 and storage.peak_bytes <= READ_PIECE_BYTES + read_beside_rows(1)


def test_load_full_state_dict_reads_every_entry_within_one_bound_on_bytes_in_flight(saved):
    """The 2.5 MiB tensors and the pieces of the big one share one budget: at most two of those at once, not one
    per thread."""
    budget = 5 * MIB
    ckpt, storage = counting_checkpoint(saved[0], requests=8, max_bytes=budget)

    loaded = ckpt.load_full_state_dict()

    assert_state_equal(loaded, saved[1])
    assert storage.peak_bytes <= budget + read_beside_rows(2), storage.peak_bytes
    assert 1 < storage.peak_reads <= 8


def test_load_full_state_dict_keeps_no_more_requests_in_flight_than_the_storage_allows(saved):
    ckpt, storage = counting_checkpoint(saved[0], requests=3)

    loaded = ckpt.load_full_state_dict()

    assert_state_equal(loaded, saved[1])
    assert storage.peak_reads == 3


def test_load_full_state_dict_counts_every_byte_on_its_progress_bar(saved, monkeypatch):
    counted: list[int] = []

    class Bar:
        def __init__(self, total, *args, **kwargs):
            self.total = total

        def update(self, n):
            counted.append(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    bars: list[Bar] = []
    monkeypatch.setattr("dcp_zarr.offline.progress_bar", lambda *a, **k: bars.append(Bar(*a, **k)) or bars[-1])

    open_checkpoint(saved[0]).load_full_state_dict(progress=True)

    assert sum(counted) == bars[0].total == sum(e.nbytes for e in open_checkpoint(saved[0]))


# -- exact reads -----------------------------------------------------------------------------------------------------

def test_a_region_across_pieces_and_inner_chunks_is_exact_and_fetches_each_inner_chunk_once(saved):
    ckpt, storage = counting_checkpoint(saved[0], requests=4)
    full = saved[1]["model"]["big"]

    for rows, cols in ((slice(30, 2599), slice(5, 900)), (slice(1023, 1025), slice(None)), (slice(2560, 2600), 7)):
        storage.ranges.clear()
        assert torch.equal(ckpt.read_tensor("model.big", region=(rows, cols)), full[rows, cols]), (rows, cols)
        assert len(storage.ranges) == len(set(storage.ranges)), storage.ranges


def test_a_0d_tensor_is_one_read_or_none_where_its_fill_value_holds_it(saved):
    ckpt, storage = counting_checkpoint(saved[0], requests=4)

    assert ckpt.read_tensor("model.half_scale").item() == 0.25
    assert ckpt.read_array("model.half_scale").shape == ()
    assert len(storage.ranges) == 2
    storage.ranges.clear()
    assert ckpt.entry("model.scale").fill == 0.25 and ckpt.entry("model.half_scale").fill is None
    assert ckpt.read_tensor("model.scale").item() == 0.25 and ckpt.read_array("model.scale").shape == ()
    assert storage.ranges == []


def test_a_region_without_elements_reads_nothing(saved):
    ckpt, storage = counting_checkpoint(saved[0], requests=4)

    assert ckpt.read_tensor("model.big", region=(slice(7, 7),)).shape == (0, 1024)
    assert ckpt.read_array("model.big", region=(slice(None), slice(3, 3))).shape == (2600, 0)
    assert ckpt.read_tensor("model.empty").shape == (0, 5)
    assert storage.ranges == [] and storage.peak_reads == 0


def test_read_jobs_fill_the_region_in_any_order_each_job_counting_its_rows(saved):
    ckpt = open_checkpoint(saved[0])
    reader = ckpt.region_reader(ckpt.entry("model.big"))
    full = saved[1]["model"]["big"].numpy()
    out = np.empty((2570, 1000), dtype=np.float32)

    jobs = reader.read_jobs([30, 24], out, piece_bytes=MIB)

    rows = [n // (1000 * 4) for n, _ in jobs]  # each job's bytes are its rows'
    ends = np.cumsum([30, *rows])
    inner = reader.layout.inner_rows
    assert len(jobs) > 2 and ends[-1] == 2600 and all(end % inner == 0 for end in ends[1:-1]), (inner, rows)
    assert max(rows) * 1000 * 4 <= MIB
    for _, job in reversed(jobs):
        job()
    assert np.array_equal(out, full[30:2600, 24:1024])


def test_read_jobs_of_a_0d_array_is_one_and_of_an_empty_region_none(saved):
    ckpt = open_checkpoint(saved[0])

    scalar = np.empty((), dtype=ml_dtypes.bfloat16)
    jobs = ckpt.region_reader(ckpt.entry("model.half_scale")).read_jobs([], scalar)
    assert [n for n, _ in jobs] == [2] and jobs[0][1]() > 0 and scalar.item() == 0.25
    assert ckpt.region_reader(ckpt.entry("model.big")).read_jobs([5, 0], np.empty((0, 1024), np.float32)) == []
