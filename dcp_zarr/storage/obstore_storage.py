"""Object-store URLs (``s3://``, ``gs://``, ``az://``) through obstore, the Rust client behind zarr's own
``zarr.storage.ObjectStore``: the default wherever obstore is installed (the ``s3``, ``gcs`` and ``azure`` extras
install it), fsspec's file systems (s3fs, gcsfs, adlfs) where it is not or where ``storage_options`` say
``client="fsspec"``.

Why obstore (benchmarks/reports/object-stores.md, measured on radosgw): s3fs builds an aiobotocore session per file
system and per thread's event loop, so a fresh process's first save of ~500 small tensors took 7.6 s against 2.6 s
later, and later saves 1.8x what the server needs for that many objects; through obstore 1.07-1.13x and 1.12-1.14x.

One client per process for each bucket and option set (``_bucket_store``): every root opened in that bucket (each
step of a manager, the earlier checkpoint of an incremental save, the lease) shares its connection pool, and a
server-side copy between two of them is one request. What zarr's ``ObjectStore`` does not choose, this does:

* a PUT is single up to ``MULTIPART_ABOVE`` and a multipart upload above it (zarr's ``set`` goes multipart above
  5 MiB, three requests and more for a 6 MiB shard; S3 refuses a single PUT above 5 GiB, and a server may set less);
* a read of more than ``SPLIT_READS_ABOVE`` bytes is ``RANGE_PART_BYTES`` ranged GETs in flight together;
* deleting a root lists it and deletes in batches (S3's DeleteObjects takes 1,000 keys a request);
* obstore's own retries are off unless configured: storage/retry.py is the one retry layer;
* the IO threads call obstore's blocking functions, not zarr's ``ObjectStore``: those release the GIL and wait on
  obstore's own runtime, where a call through zarr hops to zarr's event loop thread and back. 1,000 GETs of 40 KB,
  32 threads, on radosgw: 0.47-0.49 s and 0.21-0.22 s of the client's CPU against 0.79-0.80 s and 0.52-0.57 s through
  the loop; PUTs 0.25-0.27 s of CPU against 0.47-0.57 s. zarr's store stays for zarr's own API (listing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from zarr.abc.store import SuffixByteRequest
from zarr.core.sync import sync

from dcp_zarr.errors import ObjectStoreError
from dcp_zarr.storage.base import Storage
from dcp_zarr.storage.retry import Retrying
from dcp_zarr.storage.zarr_store import ZarrStoreStorage

# Single PUTs up to this; above it, multipart uploads of PART_BYTES parts, PARTS_IN_FLIGHT at a time. 32 MiB: above
# the shards of most saves (a single PUT is one request), far below S3's 5 GiB single-PUT limit.
MULTIPART_ABOVE = 32 << 20
PART_BYTES = 16 << 20
PARTS_IN_FLIGHT = 8
SPLIT_READS_ABOVE = 32 << 20
RANGE_PART_BYTES = 16 << 20
CLIENTS_KEPT = 32  # bucket clients cached per process (a job uses one or two)
# Which environment variables a client may have read its credentials, region or endpoint from: part of the cache key.
_ENVIRONMENT_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")

_CLIENTS: OrderedDict[str, Any] = OrderedDict()
_CLIENTS_LOCK = threading.Lock()


def obstore_installed() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def _split(location: str) -> tuple[str, str]:
    """``("s3://bucket", "path/to/root")`` of ``s3://bucket/path/to/root``."""
    scheme, rest = location.split("://", 1)
    bucket, _, path = rest.partition("/")
    return f"{scheme}://{bucket}", path.strip("/")


def _bucket_store(bucket_url: str, options: dict):
    """The obstore client of ``bucket_url`` with ``options``, built once per process."""
    from dcp_zarr.storage.obstore_options import obstore_store

    environment = {k: v for k, v in os.environ.items() if k.startswith(_ENVIRONMENT_PREFIXES)}
    key = json.dumps([bucket_url, options, environment], sort_keys=True, default=repr)
    with _CLIENTS_LOCK:
        if key in _CLIENTS:
            _CLIENTS.move_to_end(key)
            return _CLIENTS[key]
    store = obstore_store(bucket_url, options)
    with _CLIENTS_LOCK:
        store = _CLIENTS.setdefault(key, store)
        while len(_CLIENTS) > CLIENTS_KEPT:
            _CLIENTS.popitem(last=False)
    return store


class ObstoreStorage(ZarrStoreStorage):
    """A root under a bucket, through that bucket's obstore client (``raw``) and zarr's ``ObjectStore`` over it."""

    @classmethod
    def open(cls, location: str, storage_options: dict | None, *, sync_files: bool, read_only: bool,
             retrying: Retrying) -> ZarrStoreStorage:
        """obstore unless ``storage_options`` say ``client="fsspec"`` or obstore is not installed."""
        options = dict(storage_options or {})
        client = options.pop("client", "obstore" if obstore_installed() else "fsspec")
        if client == "fsspec":
            return ZarrStoreStorage.open(location, options, sync_files=sync_files, read_only=read_only,
                                         retrying=retrying)
        if client != "obstore":
            raise ValueError(f"{location}: storage_options client={client!r}: expected 'obstore' or 'fsspec'")
        if not obstore_installed():
            raise ImportError(f"{location}: storage_options client='obstore' needs obstore: pip install "
                              "'dcp-zarr[s3]' (or [gcs], [azure])")
        from zarr.storage import ObjectStore

        bucket_url, prefix = _split(location)
        raw = _bucket_store(bucket_url, options)
        return cls(ObjectStore(raw, read_only=read_only), location, retrying, prefix=prefix)

    def _call(self, operation, what: str, key: str):
        """A read of a missing key is ``FileNotFoundError`` naming it (Storage's contract, and what zarr's
        ``FsspecStore`` gives), not a failed call; a write under a missing bucket stays an ``ObjectStoreError``."""
        try:
            return super()._call(lambda: _as_python_error(operation), what, key)
        except ObjectStoreError as exc:
            if what == "read" and isinstance(exc.__cause__, FileNotFoundError):
                raise FileNotFoundError(f"{self.url}: no key {key!r}") from exc.__cause__
            raise

    def __init__(self, store, url: str, retrying: Retrying | None = None, prefix: str = ""):
        super().__init__(store, url, retrying, prefix)
        self.links_objects = True  # S3's CopyObject, GCS's rewrite, Azure's copy: within one client's bucket

    @property
    def raw(self):
        """The obstore client (zarr's ``ObjectStore.store``)."""
        return self.store.store  # type: ignore[attr-defined]

    def _writable(self) -> None:
        self.store._check_writable()  # zarr's ObjectStore refuses writes where it was opened read-only

    def write(self, key: str, buffers: Sequence) -> None:
        import obstore

        self._writable()
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        path = self._path(key)
        self._call(lambda: obstore.put(self.raw, path, data, use_multipart=len(data) > MULTIPART_ABOVE,
                                       chunk_size=PART_BYTES, max_concurrency=PARTS_IN_FLIGHT), "write", key)

    def _get(self, key: str, byte_range=None) -> bytes:
        import obstore

        path = self._path(key)
        if byte_range is None:
            return self._call(lambda: bytes(obstore.get(self.raw, path).bytes()), "read", key)
        if isinstance(byte_range, SuffixByteRequest):
            options: Any = {"range": {"suffix": byte_range.suffix}}  # obstore's GetOptions, a TypedDict
            return self._call(lambda: bytes(obstore.get(self.raw, path, options=options).bytes()), "read", key)
        return self._call(lambda: bytes(obstore.get_range(self.raw, path, start=byte_range.start,
                                                          end=byte_range.end)), "read", key)

    def exists(self, key: str) -> bool:
        import obstore

        def found() -> bool:
            try:
                obstore.head(self.raw, self._path(key))
            except FileNotFoundError:
                return False
            return True

        return self._call(found, "look up", key)

    def size(self, key: str) -> int:
        import obstore

        try:
            return int(self._call(lambda: obstore.head(self.raw, self._path(key))["size"], "look up the size of", key))
        except ObjectStoreError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise FileNotFoundError(f"{self.url}: no key {key!r}") from exc.__cause__
            raise

    def remove(self, key: str) -> None:
        import obstore

        self._writable()

        def delete() -> None:
            with contextlib.suppress(FileNotFoundError):  # GCS and Azure refuse a missing key, S3 does not
                obstore.delete(self.raw, self._path(key))

        self._call(delete, "delete", key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Storage's ``read_range_into`` reads through this too, so a large read into buffers is split as well."""
        if length <= SPLIT_READS_ABOVE:
            return super().read_range(key, start, length)
        return self._call(lambda: sync(self._read_parts(key, start, length)), "read", key)

    async def _read_parts(self, key: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``start`` as ranged GETs of ``RANGE_PART_BYTES``: the first tells the object's
        size (callers ask for more than there may be: a bound, not a size), the rest go in flight together."""
        import obstore

        path = self._path(key)
        try:
            first = await obstore.get_async(self.raw, path, options={"range": (start, start + RANGE_PART_BYTES)})
        except Exception as exc:
            from dcp_zarr.storage.retry import http_status

            if http_status(exc) == 416:  # the range starts at or past the end: nothing there, as for a short read
                return b""
            raise
        end = min(int(first.meta["size"]), start + length)
        head = await first.bytes_async()
        if end - start <= len(head):
            return bytes(memoryview(head)[: max(0, end - start)])
        target = bytearray(end - start)
        target[: len(head)] = memoryview(head)

        async def fetch(offset: int) -> None:
            stop = min(end, offset + RANGE_PART_BYTES)
            target[offset - start: stop - start] = memoryview(
                await obstore.get_range_async(self.raw, path, start=offset, end=stop))

        async with asyncio.TaskGroup() as parts:
            for offset in range(start + len(head), end, RANGE_PART_BYTES):
                parts.create_task(fetch(offset))
        return bytes(target)

    def link_from(self, source: Storage, key: str) -> bool:
        """One server-side copy where ``source`` is a root of the same bucket client; else read and write."""
        if not (isinstance(source, ObstoreStorage) and source.raw is self.raw):
            return Storage.link_from(self, source, key)
        import obstore

        self._writable()
        origin, destination = source._path(key), self._path(key)
        try:
            self._call(lambda: obstore.copy(self.raw, origin, destination), "copy", key)
        except Exception as exc:
            if isinstance(exc.__cause__, FileNotFoundError) or isinstance(exc, FileNotFoundError):
                raise FileNotFoundError(f"{source.url}: no key {key!r}") from exc
            raise
        return True

    def remove_all(self) -> None:
        """List this root and delete what it holds in batches (S3: DeleteObjects, 1,000 keys a request)."""
        import obstore

        self._writable()

        def delete_all() -> None:
            # a prefix is whole path segments to object_store: "a/b" lists a/b/..., never a/bc
            paths = [meta["path"] for meta in obstore.list(self.raw, self.prefix or None).collect()]
            if paths:
                obstore.delete(self.raw, paths)

        self._call(delete_all, "delete everything under", "")


def _as_python_error(operation):
    """``operation()``, obstore's errors raised as the Python errors they stand for (chained), as fsspec's are: a
    missing key ``FileNotFoundError`` (obstore says so for a whole GET, not for a ranged one: a 404 either way), a
    refused one ``PermissionError``; everything else unchanged, for retry.py to classify."""
    try:
        return operation()
    except FileNotFoundError:
        raise
    except Exception as exc:
        from dcp_zarr.storage.retry import http_status

        name = type(exc).__name__
        if name in ("PermissionDeniedError", "UnauthenticatedError") or http_status(exc) == 403:
            raise PermissionError(f"{name}: {_first_line(exc)}") from exc
        if http_status(exc) == 404:
            raise FileNotFoundError(f"{name}: {_first_line(exc)}") from exc
        raise


def _first_line(exc: BaseException) -> str:
    return str(exc).split("\n", 1)[0]
