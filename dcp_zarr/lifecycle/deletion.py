"""Deleting step stores so that no crash leaves one looking complete, and removing what stopped saves and deletions
left behind.

A store in a directory on this machine is first renamed into the staging directory (atomic: it is gone from the
listing at once), then removed. An object store has no rename: a ``deleting-N`` record naming the store is written
(records.py), then the store's commit marks are deleted (step_forms.py: what makes it complete goes first), then the
rest, then the record; a manager that finds the record finishes the deletion of the store it names.
"""

from __future__ import annotations

import os
import shutil
import uuid

from dcp_zarr.lifecycle.listing import DELETING_MARK, leftovers, step_stores
from dcp_zarr.lifecycle.records import record_key, records, remove_record, write_record
from dcp_zarr.lifecycle.root_storage import RootStorage
from dcp_zarr.lifecycle.step_forms import OURS, form_of, step_name
from dcp_zarr.store_io.commit import STAGING_DIR, remove_staging_dir


def delete_step(root: RootStorage, step: int, name: str | None = None) -> None:
    """Delete the step store ``name`` (default: ``step_name(step)``) so that no crash leaves it looking complete."""
    name = name or step_name(step)
    if root.directory is not None:
        _delete_by_renaming(root.directory, name)
        return
    # The name too: a manager that finds the record finishes the deletion of this store, whatever form it is named in
    # (a torchtitan root's step-N), not of a step-N.zarr that may not be there.
    write_record(root, "deleting", step, {"step": step, "name": name})
    found = form_of(name)
    (found[0] if found else OURS).delete(root, name)
    remove_record(root, "deleting", step)


def _delete_by_renaming(directory: str, name: str) -> None:
    source = os.path.join(directory, name)
    aside = os.path.join(directory, STAGING_DIR, f"{name}{DELETING_MARK}{uuid.uuid4().hex[:12]}")
    for attempt in range(3):
        if not os.path.lexists(source):
            return
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        try:
            os.rename(source, aside)
            break
        except FileNotFoundError:
            # The staging directory vanished between the two calls: a save's commit removes it once it is empty, as it
            # was for that instant (retention deletes on its own thread while the next save runs). Make it again.
            if attempt == 2:
                raise
    shutil.rmtree(aside)
    remove_staging_dir(aside)


def _recorded_name(root: RootStorage, step: int) -> str:
    """The store a ``deleting`` record of ``step`` names, if it names one of that step (records written before
    the name was kept name none: ``step-N.zarr``, the only store those deleted)."""
    name = (root.read_json(record_key("deleting", step)) or {}).get("name")
    if isinstance(name, str) and (found := form_of(name)) is not None and found[1] == step:
        return name
    return step_name(step)


def remove_incomplete(root: RootStorage, name: str) -> None:
    """Remove a store that is not a complete checkpoint (the caller knows it is ours and nothing writes it)."""
    root.open(name, read_only=False).remove_all()


def interrupted_deletions(root: RootStorage) -> tuple[list[str], list[int]]:
    """The deletions a stopped process left under ``root``: the names renamed aside to be deleted (relative to the
    root, whatever they are named: a Lightning checkpoint's may hold no step; only a deletion renames into the staging
    directory under ``DELETING_MARK``), and the steps of the ``deleting`` records."""
    set_aside = [f"{STAGING_DIR}/{name}" for name in root.names(STAGING_DIR) if DELETING_MARK in name] \
        if root.storage.commits_by_rename else []
    return set_aside, [step for kind, step in records(root) if kind == "deleting"]


def finish_deletions(root: RootStorage, interrupted: tuple[list[str], list[int]]) -> list[str]:
    """Finish ``interrupted`` (``interrupted_deletions``'s, taken before the caller's own first deletion began).
    Unlike ``clean_leftovers`` it touches nothing a save left, so it needs no lease: a save of the caller's may be
    running. Returns what it removed."""
    set_aside, recorded = interrupted
    finished = []
    for aside in set_aside:
        remove_incomplete(root, aside)
        remove_staging_dir(root.location(aside))
        finished.append(aside)
    for step in recorded:
        name = _recorded_name(root, step)
        delete_step(root, step, name)  # finishes it, its record last
        finished.append(f"{name} (a deletion that was interrupted)")
    return finished


def clean_leftovers(root: RootStorage, *, dry_run: bool = False) -> list[str]:
    """Remove what saves and deletions that are no longer running left behind; the caller holds the lease, so
    none is running. Returns what it removed (or would remove)."""
    removed = []
    for name in leftovers(root):
        removed.append(name)
        if not dry_run:
            remove_incomplete(root, name)
            if name.startswith(STAGING_DIR + "/"):
                remove_staging_dir(root.location(name))
    # A saving record is of this package's save of step-N.zarr, never of another name of step N (a deleting record
    # names its store).
    by_step = {s.step: s for s in step_stores(root) if s.name == step_name(s.step)}
    for kind, step in records(root):
        store = by_step.get(step)
        if kind == "deleting":
            name = _recorded_name(root, step)
            removed.append(f"{name} (a deletion that was interrupted)")
            if not dry_run:
                delete_step(root, step, name)  # finishes it, its record last
            continue
        if store is not None and not store.complete:
            removed.append(f"{store.name} (incomplete: its save was interrupted)")
            if not dry_run:
                remove_incomplete(root, store.name)
        if not dry_run:
            remove_record(root, "saving", step)
    return removed
