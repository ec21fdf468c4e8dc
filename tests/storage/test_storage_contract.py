"""Every Storage backend against one contract (dcp_zarr/testing/storage_contract.py): a local directory, zarr's
MemoryStore given as a store object, an fsspec URL (memory://), s3fs and obstore against the loopback S3 server."""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest
import zarr.storage

from dcp_zarr.storage import LocalStorage, local, open_storage, store_objects
from dcp_zarr.storage.retry import Retrying
from dcp_zarr.storage.throttled import ThrottledStorage
from dcp_zarr.storage.zarr_store import ZarrStoreStorage
from dcp_zarr.testing.storage_contract import FAST_RETRY, StorageContract


class _FailingStore:
    """A zarr store whose next calls fail with ``error`` (``count`` of them), underneath ZarrStoreStorage's
    retries; every other attribute is the real store's."""

    _FAILING = ("set", "get", "exists", "delete", "delete_dir")

    def __init__(self, store, count: int, error: BaseException):
        self._store, self._left, self._error, self.calls = store, count, error, 0

    def __getattr__(self, name):
        real = getattr(self._store, name)
        if name not in self._FAILING:
            return real

        async def maybe_failing(*args, **kwargs):
            self.calls += 1
            if self._left > 0:
                self._left -= 1
                raise self._error
            return await real(*args, **kwargs)

        return maybe_failing


class ZarrStoreContract(StorageContract):
    def break_next_calls(self, storage, count, error, monkeypatch):
        failing = _FailingStore(storage.store, count, error)
        monkeypatch.setattr(storage, "store", failing)
        return lambda: failing.calls


class S3Contract(ZarrStoreContract):
    """Against the loopback S3 server, which counts the bytes of every request's body."""

    @contextlib.contextmanager
    def counting_transfers(self):
        with self.server.counting() as traffic:
            yield lambda: traffic.bytes_in + traffic.bytes_out

    def storage_options(self):
        return self.server.storage_options()


class TestLocalStorage(StorageContract):
    writes_at_offsets = True
    retries_transient_faults = False  # a local file system's errors are final: surfaced at once, naming the file
    links_objects = True  # a hard link

    def same_object(self, source, target, key):
        return os.path.samefile(source.location(key), target.location(key))

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.root = tmp_path

    def make_storage(self, name, retry=FAST_RETRY):
        return LocalStorage(str(self.root / name))

    def break_next_calls(self, storage, count, error, monkeypatch):
        real, calls = local.os.pwritev, [0]
        left = [count]

        def pwritev(fd, buffers, offset):
            calls[0] += 1
            if left[0] > 0:
                left[0] -= 1
                raise error
            return real(fd, buffers, offset)

        monkeypatch.setattr(local.os, "pwritev", pwritev)
        return lambda: calls[0]


class TestMemoryStoreObject(ZarrStoreContract):
    """zarr's MemoryStore given as ``store=``: the whole store is the root, so each name is a store of its own."""

    opened_from_locations = False

    @pytest.fixture(autouse=True)
    def _stores(self):
        self.stores: dict[str, zarr.storage.MemoryStore] = {}

    def make_storage(self, name, retry=FAST_RETRY):
        return store_objects.open_store(self.stores.setdefault(name, zarr.storage.MemoryStore()), Retrying(retry))


class TestFsspecMemoryURL(ZarrStoreContract):
    @pytest.fixture(autouse=True)
    def _bucket(self):
        self.bucket = f"memory://contract-{uuid.uuid4().hex[:8]}"

    def make_storage(self, name, retry=FAST_RETRY):
        return open_storage(f"{self.bucket}/{name}", retry=retry)


@pytest.mark.s3
class TestS3fs(S3Contract):
    links_objects = True  # S3's CopyObject: the server copies
    @pytest.fixture(autouse=True)
    def _server(self, s3):
        self.server, self.prefix = s3, f"s3fs-{uuid.uuid4().hex[:8]}"

    def make_storage(self, name, retry=FAST_RETRY):
        return open_storage(f"s3://{self.server.bucket}/{self.prefix}/{name}", self.server.storage_options(),
                            retry=retry)


@pytest.mark.s3
class TestObstoreS3(S3Contract):
    """zarr's ObjectStore given as ``store=``: links by reading and writing, which the server's counts show."""

    opened_from_locations = False
    @pytest.fixture(autouse=True)
    def _server(self, s3):
        self.server, self.prefix = s3, f"obstore-{uuid.uuid4().hex[:8]}"

    def make_storage(self, name, retry=FAST_RETRY):
        from obstore.store import S3Store

        s3_store = S3Store(self.server.bucket, prefix=f"{self.prefix}/{name}", endpoint=self.server.endpoint,
                           region="us-east-1", access_key_id="testing", secret_access_key="testing",
                           client_options={"allow_http": True})
        return store_objects.open_store(zarr.storage.ObjectStore(s3_store), Retrying(retry))


def test_every_backend_has_a_contract_subclass():
    """A new Storage implementation gets its contract run, or this fails naming it."""
    from dcp_zarr.storage.base import Storage

    # the package's own: tests subclass backends to count or fail their calls
    implementations = {cls for cls in _subclasses(Storage) if cls.__module__.startswith("dcp_zarr.")}
    covered = {LocalStorage, ZarrStoreStorage, ThrottledStorage}  # ThrottledStorage's: tests/storage/test_throttled.py
    assert implementations == covered, f"Storage subclasses without a contract test: {implementations - covered}"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
