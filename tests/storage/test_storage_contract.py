"""Every Storage backend against one contract (dcp_zarr/testing/storage_contract.py): a local directory, zarr's
MemoryStore given as a store object, an fsspec URL (memory://), and against the loopback S3 server an s3:// URL
through obstore (the default) and through s3fs, and obstore's S3Store given as a store object."""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest
import zarr.storage

from dcp_zarr.storage import LocalStorage, local, open_storage, store_objects
from dcp_zarr.storage.obstore_storage import ObstoreStorage
from dcp_zarr.storage.retry import Retrying
from dcp_zarr.storage.zarr_store import ZarrStoreStorage
from dcp_zarr.testing.s3_server import FaultRule
from dcp_zarr.testing.storage_contract import FAST_RETRY, StorageContract
from dcp_zarr.testing.throttled import ThrottledStorage


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


class S3Contract(StorageContract):
    """Against the loopback S3 server, which counts the bytes of every request's body and injects the faults: the
    next ``count`` requests are answered with the error's HTTP counterpart (a refusal 403, a timeout 503 SlowDown,
    anything else 500), and the calls made since are the requests the server saw."""

    def break_next_calls(self, storage, count, error, monkeypatch):
        action = "403" if isinstance(error, PermissionError) else "503" if isinstance(error, TimeoutError) else "500"
        rule = FaultRule(action, ("GET", "HEAD", "PUT", "POST", "DELETE"), ".", count, 0, float("inf"))
        monkeypatch.setattr(self.server._proxy, "rules", [rule])  # undone after the test
        monkeypatch.setattr(self.server._proxy, "log", [])
        return lambda: len(self.server.fault_log)

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
        return open_storage(f"s3://{self.server.bucket}/{self.prefix}/{name}", self.storage_options(), retry=retry)

    def storage_options(self):
        return self.server.storage_options(client="fsspec")


@pytest.mark.s3
class TestObstoreURL(S3Contract):
    """An ``s3://`` URL with the default client: obstore, one client for the bucket, copies within the server."""

    links_objects = True

    @pytest.fixture(autouse=True)
    def _server(self, s3):
        self.server, self.prefix = s3, f"obstore-url-{uuid.uuid4().hex[:8]}"

    def make_storage(self, name, retry=FAST_RETRY):
        storage = open_storage(f"s3://{self.server.bucket}/{self.prefix}/{name}", self.storage_options(), retry=retry)
        assert isinstance(storage, ObstoreStorage)
        return storage


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
    # ThrottledStorage's contract: tests/storage/test_throttled.py
    covered = {LocalStorage, ZarrStoreStorage, ObstoreStorage, ThrottledStorage}
    assert implementations == covered, f"Storage subclasses without a contract test: {implementations - covered}"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
