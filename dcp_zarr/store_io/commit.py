"""Where a save writes before it is complete, and how it becomes the checkpoint at the requested path: one of two
strategies, chosen by what the storage says it can (``Storage.commits_by_rename``), never by which class it is.

* ``RenameCommit`` (a local directory): every rank writes into a staging directory in ``.dcp-zarr-staging/`` beside
  the target; the coordinator writes the root ``zarr.json`` there last, fsyncs, then renames the directory onto the
  target (swapping atomically with ``renameat2(RENAME_EXCHANGE)`` when replacing). A crash at any moment leaves the
  target as it was. The staging directories sit one level down, under a name without digits, so that no framework's
  scan of the target's parent for its step folders (torchtitan's ``step-N``, Lightning's ``step=N``) ever sees one.
* ``MarkerCommit`` (an object store, or any zarr store object): there is no rename, so ranks write in place and the
  root ``zarr.json`` (written last) is the commit. Replacing an existing checkpoint there first deletes it, so it is
  refused unless ``overwrite=True``.

Whether a store holds a complete checkpoint is ``root_document``'s answer: ``read_manifest`` (the whole manifest
checked) before a save replaces it and when it is loaded, ``is_committed`` (its commit mark alone, cheap) where a
root's checkpoints are listed.
"""

from __future__ import annotations

import abc
import ctypes
import errno
import os
import re
import shutil

from dcp_zarr.errors import (
    CheckpointExistsError,
    IncompleteCheckpointError,
    MalformedMetadataError,
    NotACheckpointError,
)
from dcp_zarr.format.manifest import ROOT_KEY
from dcp_zarr.storage import Storage, directory_of, open_storage, storage_class
from dcp_zarr.store_io.root_document import read_manifest

STAGING_DIR = ".dcp-zarr-staging"
STAGING_MARK = ".partial-"  # <name>.partial-<save id>: a save's staging directory, in STAGING_DIR
LEGACY_STAGING_MARK = ".dcp-zarr-partial-"  # .<name>.dcp-zarr-partial-<save id>, beside the target (before 0.2)
# What an interrupted save leaves on an object store: zarr.json documents and chunk keys (c, c.0.1; c/0/1 in formats
# 1 and 2). The first this many keys are checked before a save clears a prefix (a bound on the listing).
_SAVE_KEY = re.compile(r"(^|/)(zarr\.json|c(\.\d+)*|c(/\d+)+)$")
_KEYS_CHECKED = 100_000
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class CommitStrategy(abc.ABC):
    """How saves through one kind of storage stage, check their target, give up and commit."""

    @abc.abstractmethod
    def staging_location(self, target: str, save_id: str) -> str:
        """Where a save with ``save_id`` writes before its commit."""

    @abc.abstractmethod
    def holds_nothing(self, target: str) -> bool:
        """Whether ``target`` is known to hold nothing without opening it (raises if it holds what no save may
        replace)."""

    @abc.abstractmethod
    def settles_uncommitted(self, storage: Storage, target: str, replace_interrupted: bool) -> bool:
        """``check_stored`` of a store without a root ``zarr.json``: True if the save may go on, False to leave the
        verdict to ``read_manifest``; raises if the save must not."""

    @abc.abstractmethod
    def removal(self, target: str) -> str:
        """How a user removes an interrupted save at ``target``."""

    def abandon(self, staging: Storage) -> None:
        prepare_staging(staging)  # the commit marker first, then the rest

    @abc.abstractmethod
    def commit(self, staging: Storage, target: str, replace: bool) -> None:
        """Make the flushed staging area the checkpoint at ``target``."""


class MarkerCommit(CommitStrategy):
    """Written in place; the root ``zarr.json``, written last, is the commit."""

    def staging_location(self, target: str, save_id: str) -> str:
        return target

    def holds_nothing(self, target: str) -> bool:
        return False  # an object store answers only a request

    def settles_uncommitted(self, storage: Storage, target: str, replace_interrupted: bool) -> bool:
        # Nothing committed there. Leftovers of an interrupted save are cleared before writing; anything else (a
        # bucket's other data, when the store is rooted at the bucket) must never be, overwrite or not.
        foreign = [key for key in storage.first_keys(_KEYS_CHECKED) if not _SAVE_KEY.search(key)]
        if foreign:
            raise CheckpointExistsError(
                f"{target} holds data that is neither a dcp_zarr checkpoint nor an interrupted save "
                f"({', '.join(map(repr, sorted(foreign)[:3]))}); a save there would delete it, so it is refused. "
                "Point the writer at a prefix of its own")
        return True

    def removal(self, target: str) -> str:
        # a command for any storage written in place (an object store, a store object's URL): its own client's
        # command would differ from one service to the next, and the credentials are the user's already
        return (f"python -c \"from dcp_zarr.storage import open_storage; open_storage('{target}').remove_all()\" "
                "(with the storage_options the save had, if any)")

    def commit(self, staging: Storage, target: str, replace: bool) -> None:
        pass  # the root zarr.json, written before, was the commit


class RenameCommit(CommitStrategy):
    """Staged in a directory beside the target, renamed onto it (or exchanged with the checkpoint it replaces)."""

    def staging_location(self, target: str, save_id: str) -> str:
        parent, name = os.path.split(_directory(target).rstrip(os.sep))
        return os.path.join(parent, STAGING_DIR, f"{name}{STAGING_MARK}{save_id}")

    def holds_nothing(self, target: str) -> bool:
        path = _directory(target)
        if not os.path.exists(path):
            return True
        if not os.path.isdir(path):
            raise CheckpointExistsError(
                f"{path} is a file, not a checkpoint directory; a save there would replace it, so it is refused. "
                "Save to another path, or remove the file first")
        return not os.listdir(path)

    def settles_uncommitted(self, storage: Storage, target: str, replace_interrupted: bool) -> bool:
        # A directory is never cleared unasked: an interrupted save only with replace_interrupted; anything else is
        # for read_manifest to name.
        why = stopped_save(storage)
        if why and replace_interrupted:
            return True
        if why:
            raise CheckpointExistsError(interrupted_save(target, why, self))
        return False

    def removal(self, target: str) -> str:
        return f"rm -r {_directory(target)}"

    def abandon(self, staging: Storage) -> None:
        super().abandon(staging)
        path = _directory(staging.url)
        shutil.rmtree(path, ignore_errors=True)
        remove_staging_dir(path)

    def commit(self, staging: Storage, target: str, replace: bool) -> None:
        """Without ``replace``, a checkpoint that appeared at ``target`` while this save ran is never replaced: the
        plain rename fails on a non-empty directory, atomically, and this save is refused instead."""
        final = _directory(target)
        source = _directory(staging.url)
        if replace and os.path.isdir(final) and os.listdir(final):
            _exchange(source, final)
            _fsync_directory(os.path.dirname(final))  # the new checkpoint is durable in place before the old one goes
            _discard(source)  # now holds the replaced checkpoint
            remove_staging_dir(source)
            return
        try:
            os.rename(source, final)  # replaces an empty directory, fails on anything else
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            shutil.rmtree(source, ignore_errors=True)
            remove_staging_dir(source)
            raise CheckpointExistsError(
                f"Checkpoint already exists: {final} was written by someone else while this save ran; refusing to "
                "replace it (overwrite=False), this save was discarded. Load that checkpoint, or save again with "
                "overwrite=True to replace it"
            ) from None
        _fsync_directory(os.path.dirname(final))
        remove_staging_dir(source)


_MARKER, _RENAME = MarkerCommit(), RenameCommit()


def strategy(storage: type[Storage]) -> CommitStrategy:
    """The commit of saves through ``storage`` (a class: ``storage_class(target)`` for a location, ``type(s)`` for
    an opened storage, which is all a zarr store object given to a writer is)."""
    return _RENAME if storage.commits_by_rename else _MARKER


def _directory(location: str) -> str:
    directory = directory_of(location)
    assert directory is not None, f"{location}: a storage that commits by rename is a directory"
    return directory


def staging_location(target: str, save_id: str) -> str:
    return strategy(storage_class(target)).staging_location(target, save_id)


def remove_staging_dir(staging: str) -> None:
    """Remove the ``STAGING_DIR`` that held ``staging`` if no other save uses it now (rmdir refuses otherwise)."""
    try:
        os.rmdir(os.path.dirname(staging))
    except OSError:
        pass


def check_target(target: str, storage_options: dict | None, overwrite: bool, *, retry=None,
                 replace_interrupted: bool = False) -> None:
    """Refuse before anything is written if the target holds data we must not replace. ``overwrite``: a complete
    checkpoint may be replaced; ``replace_interrupted``: so may an interrupted save (the writer's ``overwrite=True``,
    given explicitly: nothing replaces one by default, so that a store no save finished is never lost unasked)."""
    if strategy(storage_class(target)).holds_nothing(target):
        return
    check_stored(open_storage(target, storage_options, read_only=True, retry=retry), overwrite, target,
                 replace_interrupted=replace_interrupted)


def check_stored(storage: Storage, overwrite: bool, target: str | None = None, *,
                 replace_interrupted: bool = False) -> None:
    """``check_target`` once the storage is open (a zarr store object a writer was given is only that)."""
    target = target or storage.url
    commits = strategy(type(storage))
    if not storage.exists(ROOT_KEY) and commits.settles_uncommitted(storage, target, replace_interrupted):
        return
    try:
        read_manifest(storage)
    except IncompleteCheckpointError as exc:
        if replace_interrupted:
            return
        raise CheckpointExistsError(interrupted_save(target, str(exc), commits)) from None
    except NotACheckpointError as exc:
        raise CheckpointExistsError(
            f"{target} holds data that is not a dcp_zarr checkpoint ({exc}); a save there would replace it, so it is "
            "refused, with overwrite=True too. Save to a new or empty path, or move that data away first"
        ) from None
    if not overwrite:
        raise CheckpointExistsError(
            f"Checkpoint already exists: {target} already holds a checkpoint; pass overwrite=True to ZarrWriter to "
            "replace it (on an object store the old checkpoint is deleted before the new one is written, which is "
            "why it is not replaced by default there; on a file system it is swapped out once the new one is "
            "complete), or save to another path"
        )


def stopped_save(storage: Storage) -> str | None:
    """Why ``storage`` holds a dcp_zarr save that stopped before its commit (a root ``zarr.json`` whose manifest is
    not complete, or groups and arrays without one), or None if it holds no such thing."""
    if storage.exists(ROOT_KEY):
        try:
            read_manifest(storage)
        except IncompleteCheckpointError as exc:
            return str(exc)
        except (NotACheckpointError, MalformedMetadataError):
            return None
        return None
    keys = storage.first_keys(_KEYS_CHECKED)
    if keys and all(_SAVE_KEY.search(key) for key in keys):
        return "it has groups and arrays but no root zarr.json, which a save writes last"
    return None


def interrupted_save(target: str, why: str, commits: CommitStrategy) -> str:
    """What refusing to save over an interrupted dcp_zarr save says: what the store is, and the two ways on."""
    return (f"{target} holds an interrupted dcp_zarr save, not a checkpoint ({why}): its save stopped before the "
            "commit, so nothing loads it, and a save there does not replace it unasked. Remove it "
            f"({commits.removal(target)}), or save with overwrite=True (ZarrWriter(..., overwrite=True)) to replace it")


def prepare_staging(staging: Storage) -> None:
    """Start from an empty staging area (an object-store prefix may hold an interrupted save's chunks, or the
    checkpoint ``overwrite=True`` replaces). The commit marker goes first: a crash while the rest is deleted then
    leaves a store refused as incomplete, never one that claims to be complete with chunks missing."""
    staging.remove(ROOT_KEY)
    staging.remove_all()


def abandon(staging: Storage) -> None:
    """Delete the staging area of a save that was refused before its commit: nothing of it becomes a checkpoint."""
    strategy(type(staging)).abandon(staging)


def commit(staging: Storage, target: str, replace: bool = False) -> None:
    """Make the fully written staging area the checkpoint at ``target``: flushed, then committed as its storage
    commits (``replace``: whether a checkpoint already at ``target`` may be replaced)."""
    staging.flush()
    strategy(type(staging)).commit(staging, target, replace)


def _discard(path: str) -> None:
    """Delete a checkpoint directory, its commit marker first, so that no crash leaves it looking complete."""
    try:
        os.remove(os.path.join(path, ROOT_KEY))
    except FileNotFoundError:
        pass
    shutil.rmtree(path)


def _exchange(a: str, b: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None and renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE) == 0:
        return
    # No atomic exchange (older libc, or a filesystem without it): move the old one aside, then into place.
    aside = a + ".replaced"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
