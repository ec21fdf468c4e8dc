"""A storage behind a link of limited bandwidth, for measuring where bandwidth, not CPU, is what a save waits for
(benchmarks/compression.py's ``throttled`` target): no network emulator, no root.

``ThrottledStorage(inner, link)`` delegates every call to ``inner``; each transfer runs at the inner storage's speed
and then returns only once ``link`` would have carried its bytes, after every transfer charged to that link before
it (a token bucket: ``Link.charge``). Bytes written (``write``, ``write_at``, ``link_from``'s copy) and read
(``read``, ranges, tails, an opened value's reads) are charged; metadata calls (``exists``, ``remove``, listings) are
not: no per-request latency is modelled.

Reached by location, as any backend, once ``register_throttled()`` has run in the process: ``throttled://`` followed
by the inner storage's location (``throttled:///dev/shm/ckpt``, ``throttled://s3://bucket/ckpt``), the rate in
``storage_options["bytes_per_second"]`` and the other options passed to the inner storage. Every storage opened at
one rate in a process shares one ``Link`` (``link(rate)``): a rank's IO threads, its saves and its loads share one
connection, and a benchmark charges other writers' file I/O to the same link.

The wrapper writes in place, the root zarr.json last, as on an object store (``commits_by_rename`` is False and
``directory`` None): a commit by rename would reopen the staging directory as a plain path, around the throttle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from dcp_zarr.storage.base import Storage, StoredValue
from dcp_zarr.storage.registry import register_storage
from dcp_zarr.storage.retry import Retrying

SCHEME = "throttled"
RATE_OPTION = "bytes_per_second"
T = TypeVar("T")


class Link:
    """``bytes_per_second`` shared by every thread charging it: a transfer of n bytes that began at ``start`` returns
    once the link is free of what came before it and has carried its n bytes. ``carried`` and ``waited`` count the
    bytes charged and the seconds slept."""

    def __init__(self, bytes_per_second: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        if not bytes_per_second > 0:
            raise ValueError(f"a link's bytes_per_second must be positive, not {bytes_per_second!r}")
        self.rate, self.clock, self.sleep = float(bytes_per_second), clock, sleep
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.carried = 0
        self.waited = 0.0

    def charge(self, nbytes: int, start: float) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            self._free_at = max(self._free_at, start) + nbytes / self.rate
            until = self._free_at
            self.carried += nbytes
        delay = until - self.clock()
        if delay > 0:
            with self._lock:
                self.waited += delay
            self.sleep(delay)

    def timed(self, transfer: Callable[[], T], nbytes: Callable[[T], int]) -> T:
        """``transfer()``, then its ``nbytes(result)`` charged from when it began."""
        start = self.clock()
        result = transfer()
        self.charge(nbytes(result), start)
        return result


_LINKS: dict[float, Link] = {}
_LINKS_LOCK = threading.Lock()


def link(bytes_per_second: float) -> Link:
    """This process's one link of that rate."""
    with _LINKS_LOCK:
        return _LINKS.setdefault(float(bytes_per_second), Link(bytes_per_second))


def register_throttled() -> None:
    """Serve ``throttled://<inner location>`` with ``ThrottledStorage`` in this process (idempotent)."""
    register_storage(SCHEME, ThrottledStorage, replace=True)


def inner_location(location: str) -> str:
    prefix = f"{SCHEME}://"
    if not location.lower().startswith(prefix):
        raise ValueError(f"{location!r} is not a {prefix} location")
    return location[len(prefix):]


def _size(buffers: Sequence) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


class ThrottledStorage(Storage):
    @classmethod
    def open(cls, location: str, storage_options: dict | None, *, sync_files: bool, read_only: bool,
             retrying: Retrying) -> ThrottledStorage:
        from dcp_zarr.storage import open_storage

        options = dict(storage_options or {})
        if RATE_OPTION not in options:
            raise ValueError(f"{location}: a throttled storage needs storage_options[{RATE_OPTION!r}]")
        rate = options.pop(RATE_OPTION)
        inner = open_storage(inner_location(location), options or None, sync_files=sync_files, read_only=read_only,
                             retry=retrying)
        return cls(inner, link(rate))

    @classmethod
    def default_aggregate_below(cls, location: str) -> int:
        from dcp_zarr.storage.registry import storage_class

        inner = inner_location(location)
        return storage_class(inner).default_aggregate_below(inner)

    def __init__(self, inner: Storage, link: Link):
        self.inner, self.link = inner, link
        self.url = f"{SCHEME}://{inner.url}"
        self.batch_bytes, self.max_bytes_in_flight = inner.batch_bytes, inner.max_bytes_in_flight
        self.aggregate_below = inner.aggregate_below
        # Per instance: the inner storage's writes at offsets are this one's (asked of the opened storage). What
        # is asked of the class before opening (the commit, the collector pause) keeps the class's safe answers.
        self.writes_at_offsets = inner.writes_at_offsets  # type: ignore[misc]

    def location(self, name: str) -> str:
        return f"{SCHEME}://{self.inner.location(name)}"

    def list_names(self, prefix: str = "") -> list[str]:
        return self.inner.list_names(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def size_under(self, prefix: str) -> int:
        return self.inner.size_under(prefix)

    def requests_in_flight(self, thread_count: int) -> int:
        return self.inner.requests_in_flight(thread_count)

    def write(self, key: str, buffers: Sequence) -> None:
        self.link.timed(lambda: self.inner.write(key, buffers), lambda _: _size(buffers))

    def write_at(self, key: str, offset: int, buffers: Sequence) -> None:
        self.link.timed(lambda: self.inner.write_at(key, offset, buffers), lambda _: _size(buffers))

    def read(self, key: str) -> bytes:
        return self.link.timed(lambda: self.inner.read(key), len)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self.link.timed(lambda: self.inner.read_range(key, start, length), len)

    def read_range_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        return self.link.timed(lambda: self.inner.read_range_into(key, start, buffers), int)

    def read_tail(self, key: str, length: int) -> bytes:
        return self.link.timed(lambda: self.inner.read_tail(key, length), len)

    def open_value(self, key: str) -> StoredValue:
        return _ThrottledValue(self, self.inner.open_value(key))

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def remove(self, key: str) -> None:
        self.inner.remove(key)

    def remove_all(self) -> None:
        self.inner.remove_all()

    def first_keys(self, limit: int) -> list[str]:
        return self.inner.first_keys(limit)

    def flush(self) -> None:
        self.inner.flush()


class _ThrottledValue(StoredValue):
    """The inner storage's opened value (one open for several reads), its reads charged."""

    def __init__(self, storage: ThrottledStorage, value: StoredValue):
        super().__init__(storage, value.key)
        self.value, self.link = value, storage.link

    def read_tail(self, length: int) -> bytes:
        return self.link.timed(lambda: self.value.read_tail(length), len)

    def read_range_into(self, start: int, buffers: list[memoryview]) -> int:
        return self.link.timed(lambda: self.value.read_range_into(start, buffers), int)

    def close(self) -> None:
        self.value.close()
