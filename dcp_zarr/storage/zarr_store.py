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
# fsspec protocols whose file systems copy an object within the service, the bytes never reaching the client
# (s3fs's _cp_file is S3's CopyObject).
SERVER_SIDE_COPY = frozenset({"s3", "s3a"})


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

    def __init__(self, store: Store, url: str, retrying: Retrying | None = None, prefix: str = ""):
        self.store = store
        # Where this root's keys are in ``store``: "" where the store is the root (an FsspecStore opened at the
        # URL), the root's path in the bucket where the store is a whole bucket's (obstore_storage.py)
        self.prefix = prefix.strip("/")
        self.url = url
        self.retrying = retrying or Retrying()
        self._prototype = default_buffer_prototype()
        # A class says what all its stores can do; this one knows its file system (an S3 store copies in place).
        self.links_objects = _copies_server_side(store)

    def _path(self, key: str) -> str:
        """``key`` of this root as the store names it."""
        return f"{self.prefix}/{key}" if self.prefix and key else key or self.prefix

    def _call(self, operation, what: str, key: str):
        if key:  # "" is the root itself (delete everything under, list)
            checked_key(self.url, key)
        return call_with_retry(operation, what=what, key=key, url=self.url, retrying=self.retrying)

    def write(self, key: str, buffers: Sequence) -> None:
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        buffer = self._prototype.buffer.from_bytes(data)
        self._call(lambda: sync(self.store.set(self._path(key), buffer)), "write", key)

    def _get(self, key: str, byte_range=None) -> bytes:
        buffer = self._call(lambda: sync(self.store.get(self._path(key), self._prototype, byte_range)), "read", key)
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
        return self._call(lambda: sync(self.store.exists(self._path(key))), "look up", key)

    def remove(self, key: str) -> None:
        self._call(lambda: sync(self.store.delete(self._path(key))), "delete", key)

    def remove_all(self) -> None:
        self._call(lambda: sync(self.store.delete_dir(self.prefix)), "delete everything under", "")

    def size(self, key: str) -> int:
        self._forget_listings()  # s3fs answers from its listings where it has one

        async def size_or_none():
            try:
                return await self.store.getsize(self._path(key))
            except Exception:
                # a missing key is FileNotFoundError in fsspec's stores, obstore's own NotFoundError in ObjectStore
                if await self.store.exists(self._path(key)):
                    raise
                return None

        size = self._call(lambda: sync(size_or_none()), "look up the size of", key)
        if size is None:
            raise FileNotFoundError(f"{self.url}: no key {key!r}")
        return size

    def link_from(self, source: Storage, key: str) -> bool:
        """A server-side copy where both stores are one S3 file system's (``links_objects``); else read and write."""
        if not (self.links_objects and isinstance(source, ZarrStoreStorage) and _same_file_system(source, self)):
            return super().link_from(source, key)
        fs = self.store.fs  # type: ignore[attr-defined]  # an FsspecStore: _copies_server_side said so
        origin, destination = _fsspec_path(source.store, key), _fsspec_path(self.store, key)

        async def copy() -> bool:
            try:
                await _server_side_copy(fs, origin, destination)
            except FileNotFoundError:
                return False
            return True

        if not self._call(lambda: sync(copy()), "copy", key):
            raise FileNotFoundError(f"{source.url}: no key {key!r}")
        return True

    def first_keys(self, limit: int) -> list[str]:
        async def collect():
            found = []
            async for key in self.store.list_prefix(f"{self.prefix}/" if self.prefix else ""):
                found.append(key.removeprefix(f"{self.prefix}/") if self.prefix else key)
                if len(found) >= limit:
                    break
            return found

        return self._call(lambda: sync(collect()), "list", "")

    def list_names(self, prefix: str = "") -> list[str]:
        self._forget_listings()  # other processes write here: list afresh

        async def collect():
            return [name async for name in self.store.list_dir(self._path(prefix))]

        return sorted({name.rstrip("/") for name in self._call(lambda: sync(collect()), "list", prefix)} - {""})

    def size_under(self, prefix: str) -> int:
        self._forget_listings()
        return int(self._call(lambda: sync(self.store.getsize_prefix(self._path(prefix))), "measure", prefix))

    def _forget_listings(self) -> None:
        """fsspec file systems cache listings (s3fs does); this store's keys may have changed since."""
        invalidate = getattr(getattr(self.store, "fs", None), "invalidate_cache", None)
        if invalidate is not None:
            invalidate()


def _copies_server_side(store: Store) -> bool:
    from zarr.storage import FsspecStore

    if not isinstance(store, FsspecStore):
        return False
    protocol = store.fs.protocol
    return bool(SERVER_SIDE_COPY.intersection(protocol if isinstance(protocol, (tuple, list)) else (protocol,)))


def _same_file_system(a: ZarrStoreStorage, b: ZarrStoreStorage) -> bool:
    """Whether both stores are reached through one file system (fsspec compares the options it was made with:
    endpoint, credentials), so that one server may copy from one to the other."""
    return _copies_server_side(a.store) and a.store.fs == b.store.fs  # type: ignore[attr-defined]


def _fsspec_path(store, key: str) -> str:
    return f"{store.path.rstrip('/')}/{key}"


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


async def _server_side_copy(fs, origin: str, destination: str) -> None:
    """Copy ``origin`` to ``destination`` on the object store's side. s3fs's ``_cp_file`` first asks the origin's size
    (a HEAD) to choose a single CopyObject (up to 5 GB) or a multipart copy; a chunk is far smaller, so where s3fs has
    ``_copy_basic``, that one request is tried first (measured: 4 requests per reused chunk became 2 with the check in
    store_io/chunk_reuse.py), and ``_cp_file`` is the fallback for anything it refuses."""
    basic = getattr(fs, "_copy_basic", None)
    if basic is not None:
        try:
            await basic(origin, destination)
            return
        except FileNotFoundError:
            raise
        except Exception:  # noqa: BLE001  (too large for one CopyObject, or an s3fs without it: the general copy)
            pass
    await fs._cp_file(origin, destination)
