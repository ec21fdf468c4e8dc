"""The one interface every backend speaks: whole-key writes from a list of buffers, whole or ranged reads."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from dcp_zarr.errors import InvalidKeyError, MetadataTooLargeError
from dcp_zarr.json_documents import decode_json, json_text

if TYPE_CHECKING:
    from dcp_zarr.storage.retry import Retrying


class StoredValue:
    """Reads of one stored value through its storage's own calls (``Storage.open_value``); missing keys raise
    ``FileNotFoundError`` at the first read."""

    def __init__(self, storage: Storage, key: str):
        self.storage = storage
        self.key = key

    def read_tail(self, length: int) -> bytes:
        return self.storage.read_tail(self.key, length)

    def read_range_into(self, start: int, buffers: list[memoryview]) -> int:
        return self.storage.read_range_into(self.key, start, buffers)

    def close(self) -> None:
        pass

    def __enter__(self) -> StoredValue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def checked_key(url: str, key: str) -> list[str]:
    """The components of ``key``; ``InvalidKeyError`` if one would leave the root (keys may come from a hostile
    manifest): an empty one (``a//b``), ``.`` or ``..``."""
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidKeyError(f"{url}: key {key!r} would leave the checkpoint's root")
    return parts


class Storage(abc.ABC):
    """A flat key space (zarr's: ``model/w/c/0``, ``model/w/zarr.json``) under one checkpoint root."""

    url: str
    # Jobs smaller than this share one thread-pool task (scheduler.run_jobs). Local files: batching saves the
    # per-task overhead of thousands of tiny writes. Object stores: 0, since each write is a round trip that
    # must overlap with the others.
    batch_bytes: int = 1 << 20
    # Bytes of copies the jobs in flight may hold at once (None: the jobs copy nothing, as local writes do).
    max_bytes_in_flight: int | None = None

    # A save with ZarrSavePlanner aggregates an array held in pieces smaller than this (ZarrWriter's aggregate_below),
    # and a load reads such pieces a stored chunk at a time (ZarrReader's read_once_below): the size below which a
    # request per piece costs more than sending the piece over the process group. Object stores: every object is a
    # request (and S3 serves about 3,500 PUTs a second per prefix), so pieces up to 4 MiB are worth the exchange.
    aggregate_below: int = 4 << 20

    # What the backend can do. The layers above ask these, never which class they hold (a new backend declares
    # its own, as zarr's stores declare ``supports_partial_writes``):
    # Whether write_at works: several ranks writing parts of one file (local files, not object stores).
    writes_at_offsets: ClassVar[bool] = False
    # How a save becomes the checkpoint (store_io/commit.py): True, staged in a directory beside the target and
    # renamed onto it in one atomic step, which also swaps out a checkpoint it replaces, so replacing is safe by
    # default; False, written in place, the root zarr.json (written last) the commit, and replacing deletes first.
    # A backend that commits by rename has directories for roots (``directory`` gives one for each location).
    commits_by_rename: ClassVar[bool] = False
    # Whether a save's or load's transfers run with Python's cyclic garbage collector paused (gc_pause.py): the
    # IO threads are dcp_zarr's own and make no reference cycles (local files); a client library's may.
    transfers_pause_collector: ClassVar[bool] = False
    # Whether ``link_from`` stores an object already stored under another root without moving its bytes through
    # this process (a hard link; an object store's server-side copy). Where False, link_from reads and writes.
    # Not a ClassVar: an opened storage may know more than its class (zarr's stores: only an S3 one copies in place).
    links_objects: bool = False

    @classmethod
    def open(cls, location: str, storage_options: dict | None, *, sync_files: bool, read_only: bool,
             retrying: Retrying) -> Storage:
        """The storage of ``location`` (``open_storage`` picks the class by the location's scheme, registry.py)."""
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a location ({location})")

    @classmethod
    def default_aggregate_below(cls, location: str) -> int:
        """``aggregate_below`` of the storage ``location`` would open, without opening it."""
        return cls.aggregate_below

    @classmethod
    def directory(cls, location: str) -> str | None:
        """The directory on this machine that ``location`` names, for a backend whose roots are directories (a
        local file system); None for any other (an object store's prefix)."""
        return None

    def location(self, name: str) -> str:
        """The location of ``name`` under this root, as ``open_storage`` takes it."""
        return f"{self.url.rstrip('/')}/{name}"

    def list_names(self, prefix: str = "") -> list[str]:
        """The names directly under ``prefix`` (``""``: the root), as a directory listing gives them, sorted."""
        raise NotImplementedError(f"{self.url}: this store cannot list its keys")

    def size(self, key: str) -> int:
        """The stored size of ``key`` in bytes; ``FileNotFoundError`` if absent."""
        return len(self.read(key))

    def link_from(self, source: Storage, key: str) -> bool:
        """Store at ``key`` the object ``source`` holds at ``key``, bytes identical (incremental saves reuse what an
        earlier checkpoint stored). A backend with ``links_objects`` does it without the bytes passing through this
        process; this default reads them and writes them. A hard link shares one file with ``source``: ``write``
        replaces a linked key's file, never writes into it, but ``write_at`` writes into it and would change the
        source's too, so a key ranks fill at offsets is never linked. True where no bytes passed through this
        process (linked, or copied by the backend), False where they were read and written."""
        self.write(key, [source.read(key)])
        return False

    def write_at(self, key: str, offset: int, buffers: Sequence) -> None:
        """Write the concatenation of ``buffers`` at ``offset`` of ``key``, creating it if absent, keeping the rest:
        how the ranks fill one shard file together (``layout.array_shard_layout``)."""
        raise NotImplementedError(f"{self.url}: this store cannot write parts of a value")

    def requests_in_flight(self, thread_count: int) -> int:
        """How many IO jobs to run at once for a caller asking for ``thread_count`` threads."""
        return thread_count

    @abc.abstractmethod
    def write(self, key: str, buffers: Sequence) -> None:
        """Store the concatenation of ``buffers`` at ``key``, replacing it; never visible half-written."""

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """The whole value; ``FileNotFoundError`` naming the key if absent."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start``; fewer if the value is shorter (callers check)."""

    def read_range_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        """Fill ``buffers`` in turn with bytes from ``start``; returns how many were available (callers check)."""
        data = memoryview(self.read_range(key, start, sum(len(b) for b in buffers)))
        done = 0
        for buffer in buffers:
            piece = data[done: done + len(buffer)]
            buffer[: len(piece)] = piece
            done += len(piece)
        return done

    @abc.abstractmethod
    def read_tail(self, key: str, length: int) -> bytes:
        """The last ``length`` bytes (all of it if shorter)."""

    def open_value(self, key: str) -> StoredValue:
        """A handle for several reads of one value (a shard's index, then runs of its inner chunks): a backend that
        pays per open (local files) opens it once. Use it as a context manager."""
        return StoredValue(self, key)

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a value is stored at ``key``."""

    @abc.abstractmethod
    def remove(self, key: str) -> None:
        """Delete ``key``; nothing happens if it is absent."""

    @abc.abstractmethod
    def remove_all(self) -> None:
        """Delete every key under this root (the root itself may remain)."""

    def first_keys(self, limit: int) -> list[str]:
        """Up to ``limit`` keys under this root, in no particular order."""
        raise NotImplementedError(f"{self.url}: this store cannot list its keys")

    def read_json(self, key: str, max_bytes: int | None = None):
        """The JSON document at ``key``; one longer than ``max_bytes`` is refused before it is parsed."""
        if max_bytes is None:
            return decode_json(self.read(key))
        data = self.read_range(key, 0, max_bytes + 1)
        if len(data) > max_bytes:
            raise MetadataTooLargeError(f"{self.url}/{key} is larger than {max_bytes} bytes; refused unread")
        return decode_json(data)

    def write_json(self, key: str, document) -> None:
        """Store ``document`` at ``key`` as JSON (UTF-8, compact, as every zarr.json here)."""
        self.write(key, [json_text(document).encode()])

    def flush(self) -> None:  # noqa: B027  (not abstract: object stores have no durability step)
        """Make everything written so far durable (no-op where the backend has no such notion)."""

    def size_under(self, prefix: str) -> int:
        """The bytes stored under the name ``prefix`` (every key below it); 0 if nothing is."""
        raise NotImplementedError(f"{self.url}: this store cannot list its keys")
