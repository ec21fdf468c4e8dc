"""Which Storage class serves a location (dcp_zarr/storage/registry.py), and a backend added from outside the package:
registered for its scheme, opened by ``open_storage`` and held to the same contract as the built-in ones."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest

from dcp_zarr.storage import LocalStorage, open_storage, register_storage, storage_class, unregister_storage
from dcp_zarr.storage.base import Storage, checked_key
from dcp_zarr.storage.obstore_storage import ObstoreStorage
from dcp_zarr.storage.retry import Retrying
from dcp_zarr.storage.zarr_store import ZarrStoreStorage
from dcp_zarr.testing.storage_contract import FAST_RETRY, StorageContract

SCHEME = "dictfs"


class DictStorage(Storage):
    """A backend kept in one dict for every root: what a new backend writes, and no more. Its calls retry as an
    object store's do."""

    objects: ClassVar[dict[str, bytes]] = {}
    lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def open(cls, location, storage_options, *, sync_files, read_only, retrying):
        return cls(location, retrying)

    def __init__(self, url: str, retrying: Retrying | None = None):
        self.url = url.rstrip("/")
        self.retrying = retrying or Retrying()

    def _name(self, key: str) -> str:
        checked_key(self.url, key)
        return f"{self.url}/{key}"

    def _call(self, what: str, key: str, operation):
        return self.retrying.call(lambda: self._operate(operation), what=what, key=key, url=self.url)

    def _operate(self, operation):  # the one place every call goes through: where the contract injects faults
        with self.lock:
            return operation()

    def _keys(self) -> list[str]:
        return [name[len(self.url) + 1:] for name in self.objects if name.startswith(self.url + "/")]

    def write(self, key, buffers):
        name, data = self._name(key), b"".join(memoryview(b).cast("B") for b in buffers)
        self._call("write", key, lambda: self.objects.__setitem__(name, data))

    def read(self, key):
        name = self._name(key)
        data = self._call("read", key, lambda: self.objects.get(name))
        if data is None:
            raise FileNotFoundError(f"{self.url}: no key {key!r}")
        return data

    def read_range(self, key, start, length):
        return self.read(key)[start: start + length]

    def read_tail(self, key, length):
        return self.read(key)[-length:] if length else b""

    def exists(self, key):
        name = self._name(key)
        return self._call("look up", key, lambda: name in self.objects)

    def remove(self, key):
        name = self._name(key)
        self._call("delete", key, lambda: self.objects.pop(name, None))

    def remove_all(self):
        def remove():
            for key in self._keys():
                del self.objects[f"{self.url}/{key}"]

        self._call("delete everything under", "", remove)

    def first_keys(self, limit):
        return self._call("list", "", self._keys)[:limit]

    def size_under(self, prefix):
        keys = self._call("list", prefix, self._keys)
        return sum(len(self.objects[f"{self.url}/{key}"]) for key in keys if key.startswith(f"{prefix}/"))

    def list_names(self, prefix=""):
        start = f"{prefix.rstrip('/')}/" if prefix else ""
        keys = self._call("list", prefix, self._keys)
        return sorted({key[len(start):].split("/")[0] for key in keys if key.startswith(start)})


@pytest.fixture
def dict_scheme():
    register_storage(SCHEME, DictStorage)
    yield SCHEME
    unregister_storage(SCHEME)


class TestDictStorage(StorageContract):
    """The contract holds for a backend registered from outside: the suite a new backend runs."""

    @pytest.fixture(autouse=True)
    def _registered(self, dict_scheme):
        pass

    def make_storage(self, name, retry=FAST_RETRY):
        return open_storage(f"{SCHEME}://contract/{name}", retry=retry)

    def break_next_calls(self, storage, count, error, monkeypatch):
        real, calls, left = storage._operate, [0], [count]

        def operate(operation):
            calls[0] += 1
            if left[0] > 0:
                left[0] -= 1
                raise error
            return real(operation)

        monkeypatch.setattr(storage, "_operate", operate)
        return lambda: calls[0]


def test_the_built_in_schemes_are_a_local_directory_obstore_for_object_stores_and_fsspec():
    assert storage_class("ckpt.zarr") is LocalStorage
    assert storage_class("/tmp/ckpt.zarr") is LocalStorage
    assert storage_class("file:///tmp/ckpt.zarr") is LocalStorage
    for url in ("s3://bucket/ckpt.zarr", "gs://bucket/ckpt.zarr", "az://container/ckpt.zarr"):
        assert storage_class(url) is ObstoreStorage, url
    assert storage_class("memory://ckpt.zarr") is ZarrStoreStorage


def test_a_registered_class_serves_its_scheme_and_open_storage_opens_it(dict_scheme):
    assert storage_class(f"{SCHEME}://b/ckpt.zarr") is DictStorage
    assert storage_class(f"{SCHEME.upper()}://b/ckpt.zarr") is DictStorage, "schemes are case-insensitive"
    storage = open_storage(f"{SCHEME}://b/ckpt.zarr")
    assert type(storage) is DictStorage and storage.url == f"{SCHEME}://b/ckpt.zarr"


def test_an_unregistered_scheme_goes_to_fsspec_again():
    register_storage(SCHEME, DictStorage)
    unregister_storage(SCHEME)
    assert storage_class(f"{SCHEME}://b/ckpt.zarr") is ZarrStoreStorage
    unregister_storage(SCHEME)  # forgetting a scheme not registered does nothing


def test_a_loader_is_called_only_once_a_location_of_its_scheme_is_asked(dict_scheme):
    called = []

    def load():
        called.append(True)
        return DictStorage

    register_storage("lazyfs", load)
    try:
        assert called == [], "registering imports nothing"
        assert storage_class("lazyfs://b/x") is DictStorage and called == [True]
    finally:
        unregister_storage("lazyfs")


@pytest.mark.parametrize("scheme", ["", "s3://", "my/fs"])
def test_what_is_not_a_scheme_is_refused_naming_it(scheme):
    with pytest.raises(ValueError) as info:
        register_storage(scheme, DictStorage)
    assert str(info.value) == f"register_storage: {scheme!r} is not a URL scheme (e.g. 's3', without '://')"


def test_a_scheme_registered_already_is_replaced_only_when_asked(dict_scheme):
    class Other(DictStorage):
        pass

    with pytest.raises(ValueError, match=f"scheme '{SCHEME}' is registered already; pass replace=True"):
        register_storage(SCHEME, Other)
    assert storage_class(f"{SCHEME}://x") is DictStorage
    register_storage(SCHEME, Other, replace=True)
    assert storage_class(f"{SCHEME}://x") is Other


def test_a_class_that_is_not_a_storage_is_refused_naming_it():
    with pytest.raises(TypeError, match="register_storage: dict is not a dcp_zarr Storage"):
        register_storage(SCHEME, dict)  # type: ignore[arg-type]
    assert storage_class(f"{SCHEME}://x") is ZarrStoreStorage, "nothing was registered"


@pytest.mark.parametrize("scheme", ["", "file", "FILE"])
def test_the_local_schemes_are_built_in_for_good(scheme):
    with pytest.raises(ValueError, match="is built in"):
        unregister_storage(scheme)
    assert storage_class("file:///tmp/x") is LocalStorage
