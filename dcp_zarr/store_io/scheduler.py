"""Running many IO jobs on a few threads: large jobs one by one, small ones batched.

A checkpoint of thousands of small tensors is thousands of chunk writes; a Future per write costs more than the
writes themselves (threading primitives dominate a profile of such a save), so jobs under ``batch_bytes`` run as one
batch, and the threads take the batches in turn from one list, with no Future per batch either.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from dcp_zarr.storage.base import Storage

T = TypeVar("T")

BATCH_BYTES = 1 << 20


def run_jobs(jobs: Sequence[tuple[int, Callable[[], T]]], thread_count: int, batch_bytes: int = BATCH_BYTES,
             name: str = "dcp-zarr-io", max_bytes_in_flight: int | None = None) -> list[T]:
    """Run ``(nbytes, job)`` pairs on ``thread_count`` threads; results in job order; the first error propagates.

    ``max_bytes_in_flight`` bounds the bytes of the jobs running at once (a job larger than it runs alone): for
    backends whose jobs copy their data, so many threads do not mean many copies of large chunks.
    """
    if not jobs:
        return []
    batches = _batches(jobs, batch_bytes)
    results: list = [None] * len(jobs)
    if thread_count <= 1 or len(batches) == 1:
        for batch in batches:
            _run_batch(jobs, batch, results)
        return results
    sizes = [sum(jobs[i][0] for i in batch) for batch in batches]
    _BatchRunner(jobs, batches, sizes, results, max_bytes_in_flight).run(min(thread_count, len(batches)), name)
    return results


def run_storage_jobs(storage: Storage, jobs: Sequence[tuple[int, Callable[[], T]]], thread_count: int,
                     name: str = "dcp-zarr-io") -> list[T]:
    """``run_jobs`` within ``storage``'s limits: the requests it keeps in flight for a caller asking for
    ``thread_count`` threads, its batch size and its bound on bytes in flight."""
    return run_jobs(jobs, storage.requests_in_flight(thread_count), storage.batch_bytes, name,
                    storage.max_bytes_in_flight)


class _BatchRunner:
    """Threads that each take the next batch in order (within the byte budget, if any) until none is left or one
    has failed. No Future or work item per batch: a save of hundreds of tensors has hundreds of batches, and their
    thousands of objects alive at once would bring on the garbage collector's full collections of the whole process
    (benchmarks/reports/performance.md, "Many entries, files and requests": "Fewer objects per save")."""

    def __init__(self, jobs, batches: list[list[int]], sizes: list[int], results: list, budget: int | None):
        self.jobs, self.batches, self.sizes, self.results, self.budget = jobs, batches, sizes, results, budget
        self.turn = threading.Condition()
        self.next = 0  # the next batch to take
        self.in_flight = 0  # bytes of the batches running
        self.failures: list[tuple[int, BaseException]] = []
        self.stopped = False

    def run(self, thread_count: int, name: str) -> None:
        started: list[threading.Thread] = []
        try:
            for n in range(thread_count):
                thread = threading.Thread(target=self._work, name=f"{name}_{n}")
                thread.start()
                started.append(thread)
            for thread in started:
                thread.join()
        finally:
            # also when the caller is interrupted or a thread cannot start: the others stop after the batch they
            # are running, and none is still writing once run_jobs has returned or raised
            self._stop()
            for thread in started:
                thread.join()
        if self.failures:
            raise min(self.failures, key=lambda failure: failure[0])[1]

    def _work(self) -> None:
        while (index := self._take()) is not None:
            try:
                _run_batch(self.jobs, self.batches[index], self.results)
            except BaseException as exc:  # raised by run(), on the caller's thread
                with self.turn:
                    self.failures.append((index, exc))
                self._stop()
                return
            finally:
                with self.turn:
                    self.in_flight -= self.sizes[index]
                    self.turn.notify_all()

    def _take(self) -> int | None:
        with self.turn:
            while not self.stopped and self.next < len(self.batches):
                size = self.sizes[self.next]
                # a batch larger than the whole budget waits until nothing else is in flight, then runs alone
                if self.budget is None or self.in_flight == 0 or self.in_flight + size <= self.budget:
                    self.next, self.in_flight = self.next + 1, self.in_flight + size
                    return self.next - 1
                self.turn.wait()
            return None

    def _stop(self) -> None:
        with self.turn:
            self.stopped = True
            self.turn.notify_all()


def _run_batch(jobs, batch: list[int], results: list) -> None:
    for i in batch:
        results[i] = jobs[i][1]()


def _batches(jobs: Sequence[tuple[int, Callable]], batch_bytes: int) -> list[list[int]]:
    batches: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, (nbytes, _) in enumerate(jobs):
        if nbytes >= batch_bytes:
            batches.append([i])
            continue
        current.append(i)
        current_bytes += nbytes
        if current_bytes >= batch_bytes:
            batches.append(current)
            current, current_bytes = [], 0
    if current:
        batches.append(current)
    return batches
