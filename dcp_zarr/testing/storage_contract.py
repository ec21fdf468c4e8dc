"""The behaviour every ``Storage`` backend owes the writer, the reader and the commit: one pytest class that each
backend's test subclasses, as zarr-python's ``zarr.testing.store.StoreTests`` is subclassed per store.

A subclass provides ``make_storage(name, retry)``: a fresh, empty ``Storage`` of its backend rooted at ``name``
(two names sharing a prefix, ``ckpt`` and ``ckpt2``, must be two separate roots), whose object-store calls retry by
``retry``; and ``break_next_calls(storage, count, error)``, which makes the backend's next ``count`` calls fail with
``error`` underneath the Storage (a store method, a system call), so that retries are tested where they happen.
Where it can, it also says how to count the bytes a call moves (``counting_transfers``) and whether two keys are one
stored object (``same_object``), so that ``link_from`` is held to what ``links_objects`` claims.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator
from typing import ClassVar

import numpy as np
import pytest

from dcp_zarr.errors import InvalidKeyError, MetadataTooLargeError, ObjectStoreError
from dcp_zarr.storage import open_storage, storage_class
from dcp_zarr.storage.base import Storage
from dcp_zarr.storage.retry import RetryPolicy

# Retries without waiting: the contract is about which faults are retried, not about the backoff's timing.
FAST_RETRY = RetryPolicy(attempts=3, initial_delay=0.0, max_delay=0.0)


class LinkContract:
    """What ``link_from`` owes incremental saves (an object of an earlier checkpoint stored under a new root), held
    to what ``links_objects`` claims; part of ``StorageContract``."""

    links_objects: ClassVar[bool] = False

    def make_storage(self, name: str, retry: RetryPolicy = FAST_RETRY) -> Storage:
        raise NotImplementedError("a StorageContract subclass says how to make its backend's storage")

    @contextlib.contextmanager
    def counting_transfers(self) -> Iterator[Callable[[], int | None]]:
        """Yields how many bytes went between this process and the backend since (read or written); None where the
        backend cannot count them."""
        yield lambda: None

    def same_object(self, source: Storage, target: Storage, key: str) -> bool | None:
        """Whether ``target``'s ``key`` is the very object ``source`` stores (a hard link), where the backend can
        tell; None where it cannot."""
        return None

    def _source(self, request) -> Storage:
        return self.make_storage(f"contract-{request.node.name.split('[')[0].replace('_', '-')}-source")

    def test_a_linked_object_holds_the_sources_bytes_moving_none_where_the_backend_links(self, storage, request):
        assert storage.links_objects is self.links_objects
        source = self._source(request)
        payload = np.random.default_rng(1).integers(0, 256, 256 << 10, dtype=np.uint8).tobytes()
        source.write("model/w/c.0.0", [payload])
        with self.counting_transfers() as moved:
            moved_nothing = storage.link_from(source, "model/w/c.0.0")
            through_client = moved()
        assert moved_nothing is self.links_objects, "link_from says whether the bytes stayed out of the process"
        assert storage.read("model/w/c.0.0") == payload and storage.size("model/w/c.0.0") == len(payload)
        assert source.read("model/w/c.0.0") == payload, "the source keeps its object"
        if through_client is not None:
            if self.links_objects:
                assert through_client == 0, "a backend that links objects moves no bytes through the client"
            else:
                assert through_client >= 2 * len(payload), "read from the source, written here"
        shared = self.same_object(source, storage, "model/w/c.0.0")
        assert shared is None or shared is self.links_objects

    def test_a_link_replaces_a_value_already_there(self, storage, request):
        source = self._source(request)
        source.write("model/w/c.0.0", [b"from the source"])
        storage.write("model/w/c.0.0", [b"a much longer value written here first"])
        storage.link_from(source, "model/w/c.0.0")
        assert storage.read("model/w/c.0.0") == b"from the source"

    def test_a_linked_key_removed_then_written_leaves_the_source_as_it_was(self, storage, request):
        source = self._source(request)
        source.write("model/w/c.0.0", [b"the earlier step's"])
        storage.link_from(source, "model/w/c.0.0")
        storage.remove("model/w/c.0.0")
        storage.write("model/w/c.0.0", [b"this step's"])
        assert source.read("model/w/c.0.0") == b"the earlier step's"
        assert storage.read("model/w/c.0.0") == b"this step's"

    def test_linking_a_key_the_source_lacks_is_file_not_found_naming_it(self, storage, request):
        source = self._source(request)
        source.write("model/zarr.json", [b"{}"])
        with pytest.raises(FileNotFoundError, match="c.9.9"):
            storage.link_from(source, "model/w/c.9.9")
        assert not storage.exists("model/w/c.9.9")


class StorageContract(LinkContract):
    # What the backend says of itself, checked against what it does.
    writes_at_offsets: ClassVar[bool] = False
    retries_transient_faults: ClassVar[bool] = True  # object stores do; a local file system's errors are final
    # Whether the storage is opened from a location (a path, a URL), not from a store object given as it is.
    opened_from_locations: ClassVar[bool] = True

    def make_storage(self, name: str, retry: RetryPolicy = FAST_RETRY) -> Storage:
        raise NotImplementedError("a StorageContract subclass says how to make its backend's storage")

    def break_next_calls(self, storage: Storage, count: int, error: BaseException,
                         monkeypatch) -> Callable[[], int] | None:
        """Make the next ``count`` calls fail; returns how to count the calls made since, where the backend can."""
        raise NotImplementedError("a StorageContract subclass says how to make its backend's calls fail")

    def storage_options(self) -> dict | None:
        """What ``open_storage`` needs besides a location of this backend (an endpoint, credentials)."""
        return None

    @pytest.fixture
    def storage(self, request) -> Storage:
        return self.make_storage(f"contract-{request.node.name.split('[')[0].replace('_', '-')}")

    # -- writes and whole reads ----------------------------------------------------------------------------------------

    def test_a_write_of_several_buffers_reads_back_as_their_concatenation(self, storage):
        storage.write("a/b/c.0.1", [b"head", memoryview(b"-mid-"), np.arange(3, dtype=np.uint8), bytearray(b"!")])
        assert storage.read("a/b/c.0.1") == b"head-mid-\x00\x01\x02!"
        # (whether a prefix such as "a/b" "exists" is left to the backend: fsspec says it does)
        assert storage.exists("a/b/c.0.1") and not storage.exists("a/b/c.0.2")

    def test_a_write_replaces_the_whole_value(self, storage):
        storage.write("k", [b"a much longer first value"])
        storage.write("k", [b"short"])
        assert storage.read("k") == b"short"

    def test_an_empty_value_is_stored(self, storage):
        storage.write("empty", [])
        assert storage.exists("empty") and storage.read("empty") == b""

    def test_json_documents_round_trip_and_oversized_ones_are_refused_unread(self, storage):
        document = {"zarr_format": 3, "node_type": "group", "attributes": {"x": [1, 2.5, None, "é"]}}
        storage.write_json("zarr.json", document)
        assert storage.read_json("zarr.json") == document
        assert storage.read_json("zarr.json", max_bytes=10_000) == document
        with pytest.raises(MetadataTooLargeError, match="zarr.json"):
            storage.read_json("zarr.json", max_bytes=10)

    # -- ranged reads --------------------------------------------------------------------------------------------------

    def test_ranges_and_tails_read_the_bytes_asked_for_and_no_more_than_there_are(self, storage):
        storage.write("v", [bytes(range(100))])
        assert storage.read_range("v", 10, 5) == bytes(range(10, 15))
        assert storage.read_range("v", 95, 50) == bytes(range(95, 100)), "a range past the end is cut short"
        assert storage.read_tail("v", 4) == bytes(range(96, 100))
        assert storage.read_tail("v", 500) == bytes(range(100))

    def test_a_range_is_read_into_the_callers_buffers_in_turn(self, storage):
        storage.write("v", [bytes(range(50))])
        first, second = bytearray(3), bytearray(4)
        assert storage.read_range_into("v", 7, [memoryview(first), memoryview(second)]) == 7
        assert bytes(first) == bytes(range(7, 10)) and bytes(second) == bytes(range(10, 14))
        short = bytearray(10)
        assert storage.read_range_into("v", 45, [memoryview(short)]) == 5, "what was there is counted"

    def test_an_opened_value_serves_several_reads(self, storage):
        storage.write("shard", [bytes(range(64))])
        with storage.open_value("shard") as value:
            assert value.read_tail(8) == bytes(range(56, 64))
            into = bytearray(4)
            assert value.read_range_into(16, [memoryview(into)]) == 4 and bytes(into) == bytes(range(16, 20))

    # -- writes at offsets (several ranks filling one shard) -----------------------------------------------------------

    def test_writes_at_offsets_fill_one_value_or_are_refused(self, storage):
        assert storage.writes_at_offsets is self.writes_at_offsets
        if not self.writes_at_offsets:
            with pytest.raises(NotImplementedError, match="cannot write parts"):
                storage.write_at("shard", 4, [b"x"])
            return
        storage.write_at("shard", 6, [b"world"])  # the later part first, as another rank may
        storage.write_at("shard", 0, [b"hello", b" "])
        assert storage.read("shard") == b"hello world"
        storage.write_at("shard", 0, [b"J"])
        assert storage.read("shard") == b"Jello world", "a write at an offset keeps the rest"

    # -- missing keys --------------------------------------------------------------------------------------------------

    def test_a_missing_key_is_file_not_found_naming_it_for_every_read(self, storage):
        assert not storage.exists("nope/zarr.json")
        for read in (lambda: storage.read("nope/zarr.json"), lambda: storage.read_range("nope/zarr.json", 0, 4),
                     lambda: storage.read_tail("nope/zarr.json", 4), lambda: storage.read_json("nope/zarr.json"),
                     lambda: storage.read_range_into("nope/zarr.json", 0, [memoryview(bytearray(2))])):
            with pytest.raises(FileNotFoundError, match="nope"):
                read()

    def test_removing_a_missing_key_does_nothing(self, storage):
        storage.remove("never/written")
        storage.write("kept", [b"1"])
        storage.remove("never/written")
        assert storage.read("kept") == b"1"

    def test_keys_that_would_leave_the_root_are_refused(self, storage):
        for key in ("../escape", "a/../../escape", "a//b", "./a"):
            with pytest.raises(InvalidKeyError, match="leave"):
                storage.write(key, [b"x"])
            with pytest.raises(InvalidKeyError, match="leave"):
                storage.read(key)

    # -- listing and deleting ------------------------------------------------------------------------------------------

    def test_listing_gives_every_key_under_the_root_up_to_the_limit(self, storage):
        keys = {"zarr.json", "model/zarr.json", "model/w/zarr.json", "model/w/c.0.0", "model/w/c.1.0"}
        for key in keys:
            storage.write(key, [b"x"])
        assert set(storage.first_keys(100)) == keys
        assert len(storage.first_keys(2)) == 2 and set(storage.first_keys(2)) <= keys

    def test_remove_all_empties_this_root_and_nothing_beside_it(self, storage, request):
        sibling = self.make_storage(f"contract-{request.node.name.replace('_', '-')}2")  # shares the name's start
        sibling.write("zarr.json", [b"{}"])
        storage.write("zarr.json", [b"{}"])
        storage.write("model/w/c.0.0", [b"x"])
        storage.remove_all()
        assert not storage.exists("zarr.json") and not storage.exists("model/w/c.0.0")
        assert storage.first_keys(10) == []
        assert sibling.read("zarr.json") == b"{}", "a root that only shares a prefix is never touched"
        storage.write("model/w/c.0.0", [b"again"])  # a save may start afresh in an emptied root
        assert storage.read("model/w/c.0.0") == b"again"

    # -- which class serves a location (registry.py) -------------------------------------------------------------------

    def test_a_location_under_its_root_opens_as_this_backend(self, storage):
        if not self.opened_from_locations:
            pytest.skip("a store object is opened as it is given, never from a location")
        storage.write("inner/model/zarr.json", [b"{}"])
        location = storage.location("inner")
        # the class registered for the scheme, or the one it hands the location to (obstore's to fsspec's, where
        # storage_options ask for client="fsspec"): one line of classes, so their capabilities are the same
        served_by = storage_class(location)
        assert issubclass(served_by, type(storage)) or issubclass(type(storage), served_by), (served_by, storage)
        inner = open_storage(location, self.storage_options(), retry=FAST_RETRY)
        assert type(inner) is type(storage) and inner.read("model/zarr.json") == b"{}"

    # -- what the commit needs -----------------------------------------------------------------------------------------

    def test_the_commit_marker_is_the_one_key_that_says_complete(self, storage):
        """A save writes the chunks, flushes, then the root zarr.json; a replaced checkpoint loses that marker
        first (commit.prepare_staging), so a crash in between leaves no marker over a mix of two saves."""
        storage.write("model/w/c.0.0", [b"chunk"])
        storage.flush()
        assert not storage.exists("zarr.json")
        storage.write_json("zarr.json", {"zarr_format": 3, "node_type": "group", "attributes": {}})
        storage.flush()
        assert storage.exists("zarr.json")
        storage.remove("zarr.json")
        assert not storage.exists("zarr.json") and storage.read("model/w/c.0.0") == b"chunk"

    def test_large_values_and_many_keys_survive_a_flush(self, storage):
        payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
        storage.write("big", [payload[: 1 << 20], payload[1 << 20:]])
        for i in range(50):
            storage.write(f"many/c.{i}", [bytes([i]) * 10])
        storage.flush()
        assert storage.read("big") == payload.tobytes()
        assert all(storage.read(f"many/c.{i}") == bytes([i]) * 10 for i in range(50))

    # -- faults --------------------------------------------------------------------------------------------------------

    def test_a_transient_fault_is_retried_where_the_backend_retries(self, storage, monkeypatch):
        timeout = TimeoutError("the store did not answer in time (injected)")
        self.break_next_calls(storage, 2, timeout, monkeypatch)
        if self.retries_transient_faults:
            storage.write("after-faults", [b"ok"])
            assert storage.read("after-faults") == b"ok"
        else:
            with pytest.raises(OSError, match="injected"):
                storage.write("after-faults", [b"ok"])

    def test_a_fault_that_keeps_happening_fails_naming_the_key(self, storage, monkeypatch):
        self.break_next_calls(storage, 100, OSError(errno.EIO, "input/output error (injected)"), monkeypatch)
        with pytest.raises((ObjectStoreError, OSError)) as info:
            storage.write("doomed/c.0", [b"x"])
        assert "doomed/c.0" in str(info.value) or "doomed/c.0" in str(getattr(info.value, "filename", ""))

    def test_a_permanent_fault_is_not_retried(self, storage, monkeypatch):
        calls = self.break_next_calls(storage, 100, PermissionError(errno.EACCES, "access denied (injected)"),
                                      monkeypatch)
        with pytest.raises((ObjectStoreError, PermissionError), match="denied"):
            storage.write("refused", [b"x"])
        if calls is not None:
            assert calls() == 1, "a permanent error is tried once"

    # -- names and sizes (what a checkpoint root's listing asks) -------------------------------------------------------

    def test_names_are_listed_one_level_down_sorted_and_a_missing_prefix_has_none(self, storage):
        for key in ("step-2.zarr/zarr.json", "step-2.zarr/model/w/c.0.0", "step-10.zarr/zarr.json", "notes.txt"):
            storage.write(key, [b"x"])
        assert storage.list_names() == ["notes.txt", "step-10.zarr", "step-2.zarr"]
        assert storage.list_names("step-2.zarr") == ["model", "zarr.json"]
        assert storage.list_names("nothing-here") == []

    def test_the_size_under_a_name_sums_every_key_below_it(self, storage):
        storage.write("step-1.zarr/zarr.json", [b"x" * 10])
        storage.write("step-1.zarr/model/w/c.0.0", [b"y" * 1000])
        storage.write("step-10.zarr/zarr.json", [b"z" * 7])
        assert storage.size_under("step-1.zarr") == 1010
        assert storage.size_under("missing.zarr") == 0

    def test_size_is_the_stored_length_and_a_missing_key_is_file_not_found(self, storage):
        storage.write("model/w/c.0.0", [b"12345", b"678"])
        storage.write("empty", [])
        assert storage.size("model/w/c.0.0") == 8
        assert storage.size("empty") == 0
        with pytest.raises(FileNotFoundError, match="nope"):
            storage.size("model/w/nope")
