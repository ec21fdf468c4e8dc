"""Local filesystem backend: ``writev`` straight from tensor memory, ``pread`` for ranges, optional fsync."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Sequence

from dcp_zarr.errors import InvalidKeyError, UnsafeFileError
from dcp_zarr.storage.base import Storage, StoredValue, checked_key
from dcp_zarr.storage.file_systems import is_shared
from dcp_zarr.storage.retry import Retrying

SHARED_AGGREGATE_BELOW = 1 << 20
# writev accepts at most IOV_MAX buffers per call (1024 on Linux).
_IOV_MAX = getattr(os, "sysconf", lambda _: 1024)("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class LocalStorage(Storage):
    writes_at_offsets = True
    commits_by_rename = True
    transfers_pause_collector = True
    links_objects = True

    @classmethod
    def open(cls, location: str, storage_options: dict | None, *, sync_files: bool, read_only: bool,
             retrying: Retrying) -> LocalStorage:
        return cls(local_path(location), sync_files=sync_files)  # no retries: a local error is the answer

    @classmethod
    def default_aggregate_below(cls, location: str) -> int:
        return cls(local_path(location)).aggregate_below

    @classmethod
    def directory(cls, location: str) -> str:
        return local_path(location)

    def location(self, name: str) -> str:
        return os.path.join(self.root, name)

    def list_names(self, prefix: str = "") -> list[str]:
        directory = self._path(prefix) if prefix else self.root
        try:
            return sorted(os.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, key: str) -> int:
        return os.stat(self._path(key)).st_size

    def link_from(self, source: Storage, key: str) -> bool:
        """A hard link to ``source``'s file; where that is impossible (another file system, a source that is not
        a local directory, a file system without links) the bytes are copied."""
        path = self._path(key)
        directory = os.path.dirname(path)
        if directory not in self._directories:
            _make_directory(directory)
            self._directories.add(directory)
        if isinstance(source, LocalStorage):
            try:
                os.link(source._path(key), path)
                return True
            except FileExistsError:
                os.remove(path)
                os.link(source._path(key), path)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
        return super().link_from(source, key)

    def __init__(self, root: str, *, sync_files: bool = True):
        self.root = os.path.abspath(root)
        self.url = self.root
        # Ranks already write one shard file per array here (layout.array_shard_layout). On one machine's own file
        # system the exchange never paid for a save at any piece size measured (benchmarks/reports/storage-traffic.md,
        # "Where collective I/O pays on a local file system: the defaults"): never aggregated. On a shared one
        # (Lustre, GPFS, NFS, ...), many writers' small unaligned writes to one file are what it serves worst: pieces
        # under SHARED_AGGREGATE_BELOW are aggregated (not measured here: no such file system is reachable from this
        # project's machines).
        self.aggregate_below = SHARED_AGGREGATE_BELOW if is_shared(self.root) else 0
        self.sync_files = sync_files
        self._directories: set[str] = set()  # made already: one mkdir per directory, not one per file written
        self._safe_directories: set[str] = set()  # checked to hold no symbolic link below the root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *checked_key(self.root, key))

    def write(self, key: str, buffers: Sequence) -> None:
        # A fresh store is written into a staging directory, so plain create+write is atomic enough there; a
        # temporary name would only add a rename per chunk. O_EXCL: a file already there is replaced, never
        # truncated, since it may be a hard link to an earlier checkpoint's file (link_from) that must not change.
        self._write(key, os.O_EXCL, 0, buffers)

    def write_at(self, key: str, offset: int, buffers: Sequence) -> None:
        self._write(key, 0, offset, buffers)

    def _write(self, key: str, flags: int, offset: int, buffers: Sequence) -> None:
        path = self._path(key)
        directory = os.path.dirname(path)
        if directory not in self._directories:
            _make_directory(directory)
            self._directories.add(directory)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
        except FileExistsError:  # O_EXCL's: a new store never meets one, so a fresh write costs no extra call
            os.remove(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
        try:
            pending = [memoryview(b).cast("B") for b in buffers if len(b)]
            while pending:
                written = os.pwritev(fd, pending[:_IOV_MAX], offset)
                offset += written
                _consume(pending, written)
        except OSError as exc:
            if exc.errno is not None and exc.filename is None:  # pwritev's ENOSPC / EFBIG / EIO do not say which
                exc.filename = path  # file (an OSError without an errno would print as "[Errno None] None: path")
            raise
        finally:
            os.close(fd)

    def _open_for_reading(self, key: str) -> int:
        """A descriptor of the regular file at ``key``, inside the store. A store may come from anywhere: a symbolic
        link (to /etc/passwd, or out of the store) is never followed, and a FIFO, device or directory is refused
        without blocking (``O_NONBLOCK``: opening a FIFO with no writer would wait forever)."""
        path = self._path(key)
        self._check_directory(os.path.dirname(path), key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeFileError(f"{path} is a symbolic link; files of a checkpoint are never followed") from None
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            kind = "directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "device or socket"
            raise UnsafeFileError(f"{path} is a {kind}, not a regular file; refused unread")
        return fd

    def _check_directory(self, directory: str, key: str) -> None:
        """No directory between the root and ``key`` is a symbolic link: one ``lstat`` per directory not checked
        before, about one per array (a ``realpath`` per array directory, an lstat per path component, is a visible
        share of a load of hundreds of tensors: benchmarks/reports/performance.md, "Many entries, files and
        requests")."""
        unchecked = []
        while directory != self.root and directory not in self._safe_directories:
            unchecked.append(directory)
            parent = os.path.dirname(directory)
            if parent == directory:  # _path keeps every key under the root; never walk past "/"
                raise InvalidKeyError(f"{self.root}: key {key!r} is not inside the checkpoint directory")
            directory = parent
        for directory in reversed(unchecked):
            try:
                mode = os.lstat(directory).st_mode
            except OSError:
                return  # missing (or under a file): the open that follows says so, naming the file
            if stat.S_ISLNK(mode):
                raise UnsafeFileError(f"{self.root}: a directory on the way to {key!r} is a symbolic link; files of a "
                                      "checkpoint are never followed out of its directory")
            self._safe_directories.add(directory)

    def read(self, key: str) -> bytes:
        fd = self._open_for_reading(key)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        fd = self._open_for_reading(key)
        try:
            # pread allocates all of ``length`` first: ask for no more than the file holds
            return os.pread(fd, max(0, min(length, os.fstat(fd).st_size - start)), start)
        finally:
            os.close(fd)

    def read_range_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        # Straight into the caller's (destination tensor's) memory: no intermediate buffer to allocate and copy.
        with self.open_value(key) as value:
            return value.read_range_into(start, buffers)

    def read_tail(self, key: str, length: int) -> bytes:
        with self.open_value(key) as value:
            return value.read_tail(length)

    def open_value(self, key: str) -> OpenFile:
        """The file opened once (checked as ``_open_for_reading`` checks it); ``FileNotFoundError`` if absent."""
        return OpenFile(self, key, self._open_for_reading(key))

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def remove(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self._directories.clear()

    def first_keys(self, limit: int) -> list[str]:
        found: list[str] = []
        for directory, _, files in os.walk(self.root):
            relative = os.path.relpath(directory, self.root)
            for name in files:
                found.append(name if relative == "." else f"{relative}/{name}".replace(os.sep, "/"))
                if len(found) >= limit:
                    return found
        return found

    def flush(self) -> None:
        """Make every file and directory written under this root durable, with one ``syncfs`` call.

        A checkpoint of thousands of small tensors is thousands of files: an fsync for each would be a flush per file,
        where FileSystemWriter, writing a few files, flushes a few; one syncfs flushes them all at once
        (docs/crash-safety.md, "Durability").
        """
        if self.sync_files and os.path.isdir(self.root):
            _syncfs(self.root)

    def size_under(self, prefix: str) -> int:
        total = 0
        for directory, _, files in os.walk(self._path(prefix) if prefix else self.root):
            total += sum(os.lstat(os.path.join(directory, name)).st_size for name in files)
        return total


def local_path(location: str) -> str:
    """The absolute path of a plain path or a ``file://`` URL."""
    return os.path.abspath(location[len("file://"):] if location.startswith("file://") else location)


def _make_directory(directory: str) -> None:
    """``os.makedirs(directory, exist_ok=True)`` in one ``mkdir`` when the parent exists, which is nearly always:
    makedirs adds a ``stat`` of the parent, and another when the directory exists (every rank makes every array's
    directory it writes into, so most calls find it made)."""
    try:
        os.mkdir(directory)
    except FileExistsError:
        pass  # a directory (or, if not, the open that follows fails naming the file)
    except FileNotFoundError:
        for attempt in range(3):
            try:
                os.makedirs(directory, exist_ok=True)
                return
            except FileNotFoundError:
                # A parent vanished between makedirs' steps: another save's commit removes the shared staging
                # directory (commit.STAGING_DIR) once it is empty, which it was for that instant. Make it again.
                if attempt == 2:
                    raise


def _consume(pending: list[memoryview], done: int) -> None:
    """Drop the first ``done`` bytes from ``pending`` after a partial ``pwritev``/``preadv``."""
    while pending and done >= len(pending[0]):
        done -= len(pending[0])
        pending.pop(0)
    if done:
        pending[0] = pending[0][done:]


class OpenFile(StoredValue):
    """A local file open for reading: a shard's index and its runs of inner chunks cost one open, not one each."""

    def __init__(self, storage: LocalStorage, key: str, fd: int):
        super().__init__(storage, key)
        self.fd = fd

    def read_range_into(self, start: int, buffers: list[memoryview]) -> int:
        pending = [b for b in buffers if len(b)]
        total = 0
        while pending:
            n = os.preadv(self.fd, pending, start + total)
            if n == 0:
                break
            total += n
            _consume(pending, n)
        return total

    def read_tail(self, length: int) -> bytes:
        size = os.fstat(self.fd).st_size
        start = max(0, size - length)
        return os.pread(self.fd, size - start, start)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
        if syncfs is not None and syncfs(fd) != 0:
            err = ctypes.get_errno()
            if err != errno.ENOSYS:  # a write-back error (EIO, ENOSPC): the data may not be on disk, so no commit
                raise OSError(err, f"syncfs failed: {os.strerror(err)}", path)
            syncfs = None
        if syncfs is None:
            os.sync()  # no syncfs (not Linux, or a kernel without it): flush every filesystem instead
    finally:
        os.close(fd)
