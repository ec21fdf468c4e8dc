"""How the benchmark measures: timed regions across ranks, host-memory peaks, bytes read.

Every timed region sits between two barriers; a region's time is the slowest rank's time, which is what a training
job waits for. Per-rank times are kept too, for per-rank GB/s.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from ckpt_dist import synchronize


@dataclass(frozen=True)
class RankTimes:
    """One timed region: this rank's seconds, and every rank's (same list on every rank)."""

    local_s: float
    per_rank_s: list[float]

    @property
    def max_s(self) -> float:
        return max(self.per_rank_s)


def gather_floats(value: float) -> list[float]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, float(value))
    return values


def quiesce(device: torch.device) -> None:
    """Start a timed region from rest: garbage collected, device idle, and nothing left dirty in the page cache.

    Without the sync, the write-back of whatever ran before (the previous checkpoint's deletion: 20,000 inodes for
    5,000 small tensors as zarr arrays, 9 files for FileSystemWriter) lands inside the next measurement, which is
    another writer's on alternate repeats.
    """
    gc.collect()
    synchronize(device)
    dist.barrier()
    os.sync()
    dist.barrier()


def timed_region(fn: Callable[[], Any], device: torch.device) -> tuple[RankTimes, Any]:
    """Run ``fn`` on every rank between barriers; device work (D2H copies) is waited for inside the region."""
    quiesce(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    elapsed = time.perf_counter() - start
    dist.barrier()
    return RankTimes(elapsed, gather_floats(elapsed)), result


def timed_async_save(start_save: Callable[[], Any], device: torch.device) -> tuple[RankTimes, RankTimes]:
    """Time ``dcp.async_save``: (blocking = until the call returns, total = until its future resolves).

    No collective runs between the call and ``result()``: the background save uses the default group, and a barrier
    from this thread could pair up with one of its collectives on another rank.
    """
    quiesce(device)
    start = time.perf_counter()
    response = start_save()
    blocking = time.perf_counter() - start
    upload = getattr(response, "upload_completion", response)  # AsyncSaveResponse when the stager is itself async
    upload.result()
    total = time.perf_counter() - start
    dist.barrier()
    return RankTimes(blocking, gather_floats(blocking)), RankTimes(total, gather_floats(total))


def release_free_heap() -> None:
    """Return glibc's free heap pages to the OS, so memory freed by earlier runs is not silently reused below the
    baseline (which would hide a save's allocations). A no-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRssSampler:
    """Samples this process's RSS every ~1 ms in a background thread; ``extra_bytes`` = peak - RSS at start.

    A Python thread competes for the GIL with the code it watches, so a short spike can be missed and the watched code
    runs a little slower: use it in an untimed run. RSS counts only this process's resident pages (tmpfs files written
    via write() are page cache, not RSS).
    """

    def __init__(self, interval_s: float = 0.001):
        self._interval_s = interval_s
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.baseline_bytes = 0
        self.peak_bytes = 0
        self.samples = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)
            self.samples += 1
            time.sleep(self._interval_s)

    def __enter__(self) -> PeakRssSampler:
        gc.collect()
        release_free_heap()
        self.baseline_bytes = self.peak_bytes = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)


def read_chars() -> int:
    """``rchar`` from /proc/self/io: bytes this process passed through read()/pread() (all threads).

    It counts page-cache hits as well as device reads, and socket reads too (gloo's collectives add a little);
    it misses mmap-ed reads. So it measures how much a reader asks for, not how much the disk delivered.
    """
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def have_proc_io() -> bool:
    try:
        read_chars()
        return True
    except OSError:
        return False

