"""run_jobs: results in job order, small jobs batched, the first error raised, and a bound on bytes in flight."""

from __future__ import annotations

import threading
import time

import pytest

from dcp_zarr.store_io.scheduler import run_jobs, run_storage_jobs


class Tracker:
    """Jobs that record how many bytes run at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.now = self.peak = 0
        self.threads: set[str] = set()

    def job(self, nbytes: int, value, seconds: float = 0.005):
        def run():
            with self.lock:
                self.now += nbytes
                self.peak = max(self.peak, self.now)
                self.threads.add(threading.current_thread().name)
            time.sleep(seconds)
            with self.lock:
                self.now -= nbytes
            return value
        return nbytes, run


def test_results_come_back_in_job_order_from_many_threads():
    tracker = Tracker()
    jobs = [tracker.job(10, i, seconds=0.001 * (i % 3)) for i in range(40)]
    assert run_jobs(jobs, 8, batch_bytes=0) == list(range(40))
    assert len(tracker.threads) > 1


def test_jobs_under_batch_bytes_share_a_task():
    tracker = Tracker()
    jobs = [tracker.job(1, i) for i in range(20)]
    assert run_jobs(jobs, 8, batch_bytes=1 << 20) == list(range(20))
    assert len(tracker.threads) == 1, "20 one-byte jobs are one batch, on one thread"


def test_bytes_in_flight_stay_within_the_budget_and_a_larger_job_runs_alone():
    tracker = Tracker()
    jobs = [tracker.job(10, i) for i in range(30)] + [tracker.job(100, "big")] + [tracker.job(10, i) for i in range(10)]
    results = run_jobs(jobs, 16, batch_bytes=0, max_bytes_in_flight=40)
    assert results == [*range(30), "big", *range(10)]
    assert tracker.peak == 100, "the budget holds 4 small jobs at once; the 100-byte one ran with nothing beside it"


class Limits:
    """What run_storage_jobs asks of a storage: how many requests it keeps in flight, its batches and its budget."""

    def __init__(self, requests: int, batch_bytes: int = 0, max_bytes_in_flight: int | None = None):
        self.requests, self.batch_bytes, self.max_bytes_in_flight = requests, batch_bytes, max_bytes_in_flight

    def requests_in_flight(self, thread_count: int) -> int:
        return min(thread_count, self.requests)


def test_storage_jobs_run_on_as_many_threads_as_the_storage_keeps_requests_in_flight():
    tracker = Tracker()
    results = run_storage_jobs(Limits(requests=3), [tracker.job(10, i, seconds=0.01) for i in range(12)], 16)
    assert results == list(range(12))
    assert len(tracker.threads) == 3 and tracker.peak == 30


def test_storage_jobs_stay_within_the_storages_bytes_in_flight():
    tracker = Tracker()
    run_storage_jobs(Limits(requests=16, max_bytes_in_flight=20), [tracker.job(10, i) for i in range(12)], 16)
    assert tracker.peak == 20


def test_storage_jobs_are_batched_as_the_storage_batches():
    tracker = Tracker()
    run_storage_jobs(Limits(requests=8, batch_bytes=1 << 20), [tracker.job(1, i) for i in range(20)], 8)
    assert len(tracker.threads) == 1


def test_without_a_budget_every_thread_is_busy():
    tracker = Tracker()
    run_jobs([tracker.job(10, i, seconds=0.02) for i in range(16)], 16, batch_bytes=0)
    assert tracker.peak > 40


@pytest.mark.parametrize("budget", [None, 4])
def test_the_first_error_is_raised_and_later_jobs_do_not_start(budget):
    started = []

    def failing():
        raise ValueError("job 5 failed")

    def counted(i):
        def run():
            started.append(i)
            time.sleep(0.002)
        return 1, run

    jobs = [counted(i) for i in range(5)] + [(1, failing)] + [counted(i) for i in range(6, 400)]
    with pytest.raises(ValueError, match="job 5 failed"):
        run_jobs(jobs, 4, batch_bytes=0, max_bytes_in_flight=budget)
    assert len(started) < 300, "no job is started soon after a failure"


def test_of_two_failures_the_earlier_batch_is_raised():
    release = threading.Event()

    def late_failure():
        release.wait(5)
        raise ValueError("batch 0")

    def early_failure():
        try:
            raise ValueError("batch 1")
        finally:
            release.set()  # batch 0 fails only after batch 1 has

    with pytest.raises(ValueError, match="batch 0"):
        run_jobs([(1, late_failure), (1, early_failure)], 2, batch_bytes=0)


def test_no_jobs_give_no_results():
    assert run_jobs([], 8) == []


def test_one_thread_runs_every_job_in_order_on_the_calling_thread():
    order, threads = [], set()

    def job(i):
        def run():
            order.append(i)
            threads.add(threading.current_thread())
            return i * i
        return 1 << 30, run  # each its own batch

    assert run_jobs([job(i) for i in range(5)], 1) == [0, 1, 4, 9, 16]
    assert order == list(range(5)) and threads == {threading.current_thread()}


def test_worker_threads_carry_the_given_name():
    tracker = Tracker()
    run_jobs([tracker.job(10, i) for i in range(8)], 4, batch_bytes=0, name="probe-io")
    assert tracker.threads and all(name.startswith("probe-io") for name in tracker.threads)


def test_small_jobs_are_batched_until_the_batch_reaches_batch_bytes():
    tracker = Tracker()
    # 30 jobs of 10 bytes with batch_bytes=100: three batches of ten, so at most three threads ever run one
    run_jobs([tracker.job(10, i, seconds=0.01) for i in range(30)], 8, batch_bytes=100)
    assert 1 < len(tracker.threads) <= 3 and tracker.peak <= 30


def test_an_error_on_a_single_thread_propagates():
    def failing():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_jobs([(1, lambda: 1), (1, failing)], 1)


def test_when_a_thread_cannot_start_the_started_ones_are_done_before_the_error_is_raised(monkeypatch):
    start = threading.Thread.start
    started = []

    def start_two(thread):
        if len(started) == 2:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_two)
    tracker = Tracker()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        run_jobs([tracker.job(10, i, seconds=0.01) for i in range(20)], 4, batch_bytes=0, name="probe-io")

    assert len(started) == 2 and not any(thread.is_alive() for thread in started)
    assert tracker.now == 0, "no job is running after run_jobs raised"
