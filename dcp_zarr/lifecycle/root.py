"""The directory (or object-store prefix) a ``CheckpointManager`` owns: one store per step, and its own records.

::

    root/
      step-00000003.zarr/                                  a checkpoint (complete once its root zarr.json is there)
      .dcp-zarr-staging/step-00000004.zarr.partial-*       a local save in progress, or the leftover of a killed one
      .dcp-zarr-staging/step-00000001.zarr.deleting-*      a local store being deleted (renamed away first: atomic)
      .dcp-zarr/lease.json                                 which manager holds the root (lease.py)
      .dcp-zarr/saving-00000004.json                       a save was started (object stores write in place: only
                                                           this record says an incomplete step store is ours)
      .dcp-zarr/deleting-00000001.json                     an object-store deletion was started

Step stores are also recognized under the names training frameworks give them: torchtitan's ``step-N``, Lightning's
``epoch=E-step=N`` (``.ckpt`` or not), and accelerate's ``checkpoint_N`` folders, each holding several stores and
accelerate's own files (folders.py), so ``dcp-zarr list`` and ``prune`` work on their checkpoint folders; a manager
saves under its own ``step-N.zarr`` names, and lists, loads and deletes only single stores. Only names of these
forms are ever removed, so foreign files beside the stores are never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcp_zarr.errors import ZarrCheckpointError
from dcp_zarr.format.manifest import FORMAT_NAME, MANIFEST_ATTRIBUTE, MAX_MANIFEST_BYTES, ROOT_KEY
from dcp_zarr.lifecycle.folders import FINISHED_MARK, FOLDER_NAME, folder_state
from dcp_zarr.storage import is_local, local_path, open_storage
from dcp_zarr.store_io.commit import LEGACY_STAGING_MARK, STAGING_DIR, STAGING_MARK, remove_staging_dir

if TYPE_CHECKING:
    from zarr.abc.store import Store

RECORDS = ".dcp-zarr"
DELETING_MARK = ".deleting-"  # <name>.deleting-<id>, in STAGING_DIR
# The step-store names recognized, each with the step as its one group: this package's CheckpointManager's, then
# torchtitan's CheckpointManager's, then Lightning's ModelCheckpoint's default (a store a DCP strategy writes), then
# accelerate's automatic_checkpoint_naming (a folder of stores; its N counts saves, not training steps).
STEP_NAME_FORMS = ("step-N.zarr", "step-N", "epoch=E-step=N[.ckpt]", "checkpoint_N")
_STEP_NAMES = (re.compile(r"^step-(\d+)\.zarr$"), re.compile(r"^step-(\d+)$"),
               re.compile(r"^epoch=\d+-step=(\d+)(?:\.ckpt)?$"), FOLDER_NAME)
_LEGACY_LEFTOVER = re.compile(r"^\.(step-\d+\.zarr)(" + re.escape(LEGACY_STAGING_MARK) + r"|\.dcp-zarr-deleting-)")
_STAGED = re.compile(r"^(?P<name>.+?)(" + re.escape(STAGING_MARK) + "|" + re.escape(DELETING_MARK) + r")[0-9a-f]+$")
# What marks a step folder as another format's checkpoint: DCP's FileSystemWriter, Hugging Face safetensors.
_OTHER_FORMATS = {".metadata": "a DCP checkpoint (FileSystemWriter)",
                  "model.safetensors.index.json": "Hugging Face safetensors"}
_ACCELERATES_OWN = "DCP checkpoints accelerate wrote itself"
_RECORD = re.compile(r"^(saving|deleting)-(\d+)\.json$")
STEP_DIGITS = 8


def _record_key(kind: str, step: int) -> str:
    return f"{RECORDS}/{kind}-{step:0{STEP_DIGITS}d}.json"


def step_name(step: int) -> str:
    """``step-00000042.zarr``: names sort by step up to 10**8 (larger steps still parse)."""
    return f"step-{step:0{STEP_DIGITS}d}.zarr"


def parse_step(name: str) -> int | None:
    """The step of a step store's name (``STEP_NAME_FORMS``), else None."""
    for form in _STEP_NAMES:
        match = form.match(name)
        if match:
            return int(match.group(1))
    return None


@dataclass(frozen=True)
class StepStore:
    step: int
    name: str
    complete: bool
    other_format: str | None = None  # what it is instead, when it is a step folder of another format
    folder: bool = False  # a folder of several stores (accelerate's checkpoint_N), not one store


class CheckpointRoot:
    """Listing, records and crash-safe deletion under ``root`` (a local directory or an fsspec URL)."""

    def __init__(self, root: str | os.PathLike, storage_options: dict | None = None):
        self.url = os.fspath(root).rstrip("/") or "/"
        self.storage_options = storage_options
        self.local = is_local(self.url)
        self.path = local_path(self.url) if self.local else self.url
        if self.local:
            if os.path.exists(self.path) and not os.path.isdir(self.path):
                raise NotADirectoryError(f"checkpoint root {self.path} is a file, not a directory")
            os.makedirs(self.path, exist_ok=True)
        self._storage = open_storage(self.url, storage_options)

    @property
    def _store(self) -> Store:
        """The zarr store of a URL root; only the paths that are not local use it."""
        from dcp_zarr.storage.zarr_store import ZarrStoreStorage  # imports zarr: not for local roots

        assert isinstance(self._storage, ZarrStoreStorage), "a local root has no zarr store"
        return self._storage.store

    def location(self, name: str) -> str:
        return os.path.join(self.path, name) if self.local else f"{self.url}/{name}"

    # -- what is there ---------------------------------------------------------------------------------------------

    def names(self, directory: str = "") -> list[str]:
        """The names directly under the root, or under its ``directory`` (directories and objects, one level)."""
        return self._list(directory)

    def _list(self, directory: str) -> list[str]:
        """The names directly under ``directory`` of the root (none if it does not exist), sorted."""
        if self.local:
            path = os.path.join(self.path, directory)
            return sorted(os.listdir(path)) if os.path.isdir(path) else []
        from zarr.core.sync import sync

        self._forget_listings()

        async def listing():
            return [name async for name in self._store.list_dir(directory)]

        return sorted(n.rstrip("/") for n in sync(listing()))

    def step_stores(self) -> list[StepStore]:
        """Every step store under the root (``STEP_NAME_FORMS``), ascending by step, with whether it is a complete
        checkpoint; of two names of one step, this package's ``step-N.zarr`` last. A ``checkpoint_N`` folder is
        complete when the dcp_zarr stores it holds are all committed and accelerate finished it (folders.py); one
        that is itself a committed store counts as that store."""
        found = []
        for name in self.names():
            step = parse_step(name)
            if step is not None and FOLDER_NAME.match(name) and not self.is_complete(name):
                folder = folder_state(self, name)
                only_dcp = bool(folder.dcp) and not folder.committed
                found.append(StepStore(step, name, folder.complete and not only_dcp,
                                       _ACCELERATES_OWN if only_dcp else None, folder=True))
            elif step is not None:
                complete = self.is_complete(name)
                found.append(StepStore(step, name, complete, None if complete else self._other_format(name)))
        return sorted(found, key=lambda s: (s.step, s.name == step_name(s.step)))

    def holds_dcp_checkpoint(self, name: str) -> bool:
        """Whether ``name`` is a checkpoint DCP's FileSystemWriter wrote (its ``.metadata``)."""
        return self.other_format(name) == _OTHER_FORMATS[".metadata"]

    def other_format(self, name: str) -> str | None:
        """What other format's checkpoint ``name`` holds (a DCP checkpoint, Hugging Face safetensors), by the file
        that format writes; None if none. A committed store's folder can hold one too: a run that switched back to
        DCP's own checkpointing writes DCP's files into the step folders it finds."""
        return self._other_format(name)

    def _other_format(self, name: str) -> str | None:
        storage = open_storage(self.location(name), self.storage_options, read_only=True)
        for marker, what in _OTHER_FORMATS.items():
            try:
                if storage.exists(marker):
                    return what
            except (ZarrCheckpointError, OSError):
                return None
        return None

    def is_complete(self, name: str) -> bool:
        """Whether ``name`` holds a committed dcp_zarr checkpoint: its root zarr.json carries a manifest marked
        complete. Only that is read, not the whole manifest (a root of many steps is listed often); ``load`` checks
        the rest."""
        storage = open_storage(self.location(name), self.storage_options, read_only=True)
        try:
            root = storage.read_json(ROOT_KEY, max_bytes=MAX_MANIFEST_BYTES)
        except (ZarrCheckpointError, OSError, ValueError, RecursionError):
            return False
        attributes = root.get("attributes") if isinstance(root, dict) else None
        manifest = attributes.get(MANIFEST_ATTRIBUTE) if isinstance(attributes, dict) else None
        return (isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME
                and manifest.get("complete") is True)

    def size(self, name: str) -> int:
        """Bytes stored under ``name``."""
        if self.local:
            total = 0
            for dirpath, _, filenames in os.walk(self.location(name)):
                total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in filenames)
            return total
        from zarr.core.sync import sync

        return int(sync(self._store.getsize_prefix(name)))

    def leftovers(self) -> list[str]:
        """Local staging and deleting directories of step stores (``.dcp-zarr-staging/step-N.zarr.partial-*``, and
        the ``.step-N.zarr.dcp-zarr-partial-*`` that versions before 0.2 left beside the stores), relative to the
        root."""
        if not self.local:
            return []
        staged = []
        for name in self._list(STAGING_DIR):
            match = _STAGED.match(name)
            if match and parse_step(match.group("name")) is not None:
                staged.append(f"{STAGING_DIR}/{name}")
        return staged + [name for name in self.names() if _LEGACY_LEFTOVER.match(name)]

    def _forget_listings(self) -> None:
        """fsspec file systems cache listings (s3fs does); other processes write here, so list afresh each time."""
        invalidate = getattr(getattr(self._store, "fs", None), "invalidate_cache", None)
        if invalidate is not None:
            invalidate()

    # -- records ---------------------------------------------------------------------------------------------------

    def records(self) -> list[tuple[str, int]]:
        """``("saving" | "deleting", step)`` for every record in ``.dcp-zarr/``."""
        found = []
        for name in self._list(RECORDS):
            match = _RECORD.match(name)
            if match:
                found.append((match.group(1), int(match.group(2))))
        return found

    def write_record(self, kind: str, step: int, document: dict) -> None:
        self.write_json(_record_key(kind, step), document)

    def remove_record(self, kind: str, step: int) -> None:
        self._storage.remove(_record_key(kind, step))

    def write_json(self, key: str, document: dict) -> None:
        if self.local:
            os.makedirs(os.path.dirname(os.path.join(self.path, key)), exist_ok=True)
        self._storage.write_json(key, document)

    def read_json(self, key: str) -> dict | None:
        try:
            document = self._storage.read_json(key, max_bytes=1 << 16)
        except FileNotFoundError:
            return None
        except (ValueError, ZarrCheckpointError):
            return {}  # unreadable (torn by a crash): present, but says nothing
        return document if isinstance(document, dict) else {}

    def remove_key(self, key: str) -> None:
        self._storage.remove(key)

    def remove_empty_records_folder(self) -> None:
        """Remove ``.dcp-zarr/`` if it is empty and the root holds accelerate's ``checkpoint_N`` folders: accelerate's
        ``total_limit`` takes every entry of that folder for a checkpoint and fails on a name without a number."""
        if self.local and any(FOLDER_NAME.match(name) for name in self.names()):
            try:
                os.rmdir(os.path.join(self.path, RECORDS))
            except OSError:
                pass  # records of saves or deletions are still there, or it is gone already

    # -- removing --------------------------------------------------------------------------------------------------

    def delete_step(self, step: int, name: str | None = None) -> None:
        """Delete ``step-N.zarr`` so that no crash leaves it looking complete: locally it is first renamed to a hidden
        name (atomic: it is gone from the listing at once); on an object store a record is written, then the commit
        marker deleted, then the rest, then the record. ``name``: the store's, if not the padded ``step_name``."""
        name = name or step_name(step)
        if self.local:
            source = self.location(name)
            if not os.path.lexists(source):
                return
            aside = os.path.join(self.path, STAGING_DIR, f"{name}{DELETING_MARK}{uuid.uuid4().hex[:12]}")
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            os.rename(source, aside)
            shutil.rmtree(aside)
            remove_staging_dir(aside)
            return
        self.write_record("deleting", step, {"step": step})
        self._remove_remote_store(name)
        self.remove_record("deleting", step)

    def remove_incomplete(self, name: str) -> None:
        """Remove a store that is not a complete checkpoint (the caller knows it is ours and nothing writes it)."""
        if self.local:
            shutil.rmtree(self.location(name), ignore_errors=True)
            return
        self._remove_remote_store(name)

    def clean_leftovers(self, *, dry_run: bool = False) -> list[str]:
        """Remove what saves and deletions that are no longer running left behind; the caller holds the lease, so
        none is running. Returns what it removed (or would remove)."""
        removed = []
        for name in self.leftovers():
            removed.append(name)
            if not dry_run:
                self.remove_incomplete(name)
                if name.startswith(STAGING_DIR + "/"):
                    remove_staging_dir(self.location(name))
        # The records are of this package's saves and deletions: of step-N.zarr, never of another name of step N.
        by_step = {s.step: s for s in self.step_stores() if s.name == step_name(s.step)}
        for kind, step in self.records():
            store = by_step.get(step)
            if kind == "deleting":
                removed.append(f"{step_name(step)} (a deletion that was interrupted)")
                if not dry_run:
                    self.delete_step(step)  # finishes it, its record last
                continue
            if store is not None and not store.complete:
                removed.append(f"{store.name} (incomplete: its save was interrupted)")
                if not dry_run:
                    self.remove_incomplete(store.name)
            if not dry_run:
                self.remove_record("saving", step)
        return removed

    def _remove_remote_store(self, name: str) -> None:
        storage = open_storage(self.location(name), self.storage_options)
        storage.remove(ROOT_KEY)  # what makes it complete, first: the commit marker
        if FOLDER_NAME.match(name):
            storage.remove(FINISHED_MARK)  # an accelerate folder's: the last file of its save
        storage.remove_all()


def steps_to_delete(complete: list[int], keep_last: int | None, keep_every: int | None,
                    protected: Iterable[int] = frozenset()) -> list[int]:
    """Which of the ``complete`` steps retention deletes: all but the newest ``keep_last`` (none without it), the
    multiples of ``keep_every``, the newest one and ``protected``, oldest first."""
    if keep_last is None or not complete:
        return []
    complete = sorted(complete)
    keep = set(complete[-keep_last:]) | {complete[-1]} | set(protected)
    if keep_every is not None:
        keep |= {s for s in complete if s % keep_every == 0}
    return [s for s in complete if s not in keep]
