"""Running many IO jobs on a few threads: large jobs one by one, small ones batched.

A checkpoint of 5,000 small tensors is 5,000 chunk writes; a Future per write cost more than the writes themselves
(threading primitives dominated the profile), so jobs under ``batch_bytes`` share one Future.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

T = TypeVar("T")

BATCH_BYTES = 1 << 20


def run_jobs(jobs: Sequence[tuple[int, Callable[[], T]]], thread_count: int, batch_bytes: int = BATCH_BYTES,
             name: str = "dcp-zarr-io", max_bytes_in_flight: int | None = None) -> list[T]:
    """Run ``(nbytes, job)`` pairs on ``thread_count`` threads; results in job order; the first error propagates.

    ``max_bytes_in_flight`` bounds the bytes of the jobs running or queued at once (a job larger than it runs
    alone): for backends whose jobs copy their data, so many threads do not mean many copies of large chunks.
    """
    if not jobs:
        return []
    batches = _batches(jobs, batch_bytes)

    def run_batch(indexes: list[int]) -> list[tuple[int, T]]:
        return [(i, jobs[i][1]()) for i in indexes]

    results: list = [None] * len(jobs)
    if thread_count <= 1 or len(batches) == 1:
        done = map(run_batch, batches)
        for batch in done:
            for i, value in batch:
                results[i] = value
        return results
    with ThreadPoolExecutor(min(thread_count, len(batches)), thread_name_prefix=name) as pool:
        if max_bytes_in_flight is None:
            finished = pool.map(run_batch, batches)
        else:
            finished = _submit_within_budget(pool, run_batch, batches, [sum(jobs[i][0] for i in b) for b in batches],
                                             max_bytes_in_flight)
        for batch in finished:
            for i, value in batch:
                results[i] = value
    return results


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


def _submit_within_budget(pool: ThreadPoolExecutor, run_batch, batches: list, sizes: list[int], budget: int):
    """Submit batches while their bytes in flight stay within ``budget``; yields results in order. After a failure
    nothing more is submitted, and the failure is raised when its batch's turn comes."""
    lock = threading.Condition()
    state = {"in_flight": 0, "failed": False}

    def finished(future: Future, size: int) -> None:
        with lock:
            state["in_flight"] -= size
            state["failed"] = state["failed"] or future.exception() is not None
            lock.notify_all()

    futures = []
    for batch, size in zip(batches, sizes):
        with lock:
            # a batch larger than the whole budget waits until nothing else is in flight, then runs alone (the
            # predicate may use this iteration's size: wait_for calls it only before the loop moves on)
            lock.wait_for(
                lambda: state["failed"] or state["in_flight"] == 0 or state["in_flight"] + size <= budget)  # noqa: B023
            if state["failed"]:
                break
            state["in_flight"] += size
        future = pool.submit(run_batch, batch)
        future.add_done_callback(partial(finished, size=size))
        futures.append(future)
    return (future.result() for future in futures)
