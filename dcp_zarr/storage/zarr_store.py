"""Any zarr v3 store (fsspec URLs such as ``s3://``/``memory://``, obstore, ...) behind the Storage interface."""

from __future__ import annotations

from collections.abc import Sequence

from zarr.abc.store import RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from dcp_zarr.storage.base import Storage, checked_key
from dcp_zarr.storage.retry import Retrying, call_with_retry

# Requests an object store keeps in flight per rank, at least: each waits mostly on the network (tens of ms a
# round trip), not on a core, so the thread count asked for (sized for CPUs) would leave latency unhidden
# (benchmarks/reports/performance.md, "Many entries, files and requests": "Round trips on object stores").
REQUESTS_IN_FLIGHT = 32


class ZarrStoreStorage(Storage):
    """Calls are synchronous; zarr runs them on its event loop, so calls from several threads overlap."""

    batch_bytes = 0
    max_bytes_in_flight = 256 << 20  # each write joins its buffers into one bytes object; each read returns one

    def requests_in_flight(self, thread_count: int) -> int:
        return max(thread_count, REQUESTS_IN_FLIGHT)

    @classmethod
    def open(cls, location: str, storage_options: dict | None, *, sync_files: bool, read_only: bool,
             retrying: Retrying) -> ZarrStoreStorage:
        """An fsspec URL through zarr's FsspecStore (``sync_files``: object stores have no durability step)."""
        from zarr.storage import FsspecStore

        store = FsspecStore.from_url(location, storage_options=_s3_client_options(location, storage_options),
                                     read_only=read_only)
        return cls(store, location, retrying)

    def __init__(self, store: Store, url: str, retrying: Retrying | None = None):
        self.store = store
        self.url = url
        self.retrying = retrying or Retrying()
        self._prototype = default_buffer_prototype()

    def _call(self, operation, what: str, key: str):
        if key:  # "" is the root itself (delete everything under, list)
            checked_key(self.url, key)
        return call_with_retry(operation, what=what, key=key, url=self.url, retrying=self.retrying)

    def write(self, key: str, buffers: Sequence) -> None:
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        buffer = self._prototype.buffer.from_bytes(data)
        self._call(lambda: sync(self.store.set(key, buffer)), "write", key)

    def _get(self, key: str, byte_range=None) -> bytes:
        buffer = self._call(lambda: sync(self.store.get(key, self._prototype, byte_range)), "read", key)
        if buffer is None:
            raise FileNotFoundError(f"{self.url}: no key {key!r}")
        return buffer.to_bytes()

    def read(self, key: str) -> bytes:
        return self._get(key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self._get(key, RangeByteRequest(start, start + length))

    def read_tail(self, key: str, length: int) -> bytes:
        return self._get(key, SuffixByteRequest(length))

    def exists(self, key: str) -> bool:
        return self._call(lambda: sync(self.store.exists(key)), "look up", key)

    def remove(self, key: str) -> None:
        self._call(lambda: sync(self.store.delete(key)), "delete", key)

    def remove_all(self) -> None:
        self._call(lambda: sync(self.store.delete_dir("")), "delete everything under", "")

    def first_keys(self, limit: int) -> list[str]:
        async def collect():
            found = []
            async for key in self.store.list_prefix(""):
                found.append(key)
                if len(found) >= limit:
                    break
            return found

        return self._call(lambda: sync(collect()), "list", "")

    def list_names(self, prefix: str = "") -> list[str]:
        self._forget_listings()  # other processes write here: list afresh

        async def collect():
            return [name async for name in self.store.list_dir(prefix)]

        return sorted(name.rstrip("/") for name in self._call(lambda: sync(collect()), "list", prefix))

    def size_under(self, prefix: str) -> int:
        self._forget_listings()
        return int(self._call(lambda: sync(self.store.getsize_prefix(prefix)), "measure", prefix))

    def _forget_listings(self) -> None:
        """fsspec file systems cache listings (s3fs does); this store's keys may have changed since."""
        invalidate = getattr(getattr(self.store, "fs", None), "invalidate_cache", None)
        if invalidate is not None:
            invalidate()


def _s3_client_options(url: str, storage_options: dict | None) -> dict | None:
    """Two botocore defaults overridden for ``s3://``, each unless the caller set it in ``config_kwargs``:

    * the HTTP connection pool (default 10) caps the requests in flight: make room for ``REQUESTS_IN_FLIGHT``;
    * botocore's own retries (5 attempts, backing off up to 20 s) would multiply dcp_zarr's (retry.py), and keep a
      refused endpoint's error from dcp_zarr for seconds per call (docs/crash-safety.md, "Object-store retries"):
      one attempt, so retry.py is the one layer.
    """
    if not url.startswith(("s3://", "s3a://")):
        return storage_options
    options = dict(storage_options or {})
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", REQUESTS_IN_FLIGHT)
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = config
    return options
