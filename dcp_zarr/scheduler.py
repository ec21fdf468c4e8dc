"""Running many IO jobs on a few threads: large jobs one by one, small ones batched.

A checkpoint of 5,000 small tensors is 5,000 chunk writes; a Future per write cost more than the writes themselves
(threading primitives dominated the profile), so jobs under ``batch_bytes`` share one Future.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

BATCH_BYTES = 1 << 20


def run_jobs(jobs: Sequence[tuple[int, Callable[[], T]]], thread_count: int, batch_bytes: int = BATCH_BYTES,
             name: str = "dcp-zarr-io") -> list[T]:
    """Run ``(nbytes, job)`` pairs on ``thread_count`` threads; results in job order; the first error propagates."""
    if not jobs:
        return []
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
        for batch in pool.map(run_batch, batches):
            for i, value in batch:
                results[i] = value
    return results
