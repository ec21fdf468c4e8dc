"""Deleting step stores so that no crash leaves one looking complete, and removing what stopped saves and deletions
left behind.

A store in a directory on this machine is first renamed into the staging directory (atomic: it is gone from the
listing at once), then removed. An object store has no rename: a ``deleting-N`` record is written (records.py),
then the store's commit marks are deleted (step_forms.py: what makes it complete goes first), then the rest, then
the record; a manager that finds the record finishes the deletion.
"""

from __future__ import annotations

import os
import shutil
import uuid

from dcp_zarr.lifecycle.listing import DELETING_MARK, leftovers, step_stores
from dcp_zarr.lifecycle.records import records, remove_record, write_record
from dcp_zarr.lifecycle.root_storage import RootStorage
from dcp_zarr.lifecycle.step_forms import OURS, form_of, step_name
from dcp_zarr.store_io.commit import STAGING_DIR, remove_staging_dir


def delete_step(root: RootStorage, step: int, name: str | None = None) -> None:
    """Delete the step store ``name`` (default: ``step_name(step)``) so that no crash leaves it looking complete."""
    name = name or step_name(step)
    if root.directory is not None:
        _delete_by_renaming(root.directory, name)
        return
    write_record(root, "deleting", step, {"step": step})
    found = form_of(name)
    (found[0] if found else OURS).delete(root, name)
    remove_record(root, "deleting", step)


def _delete_by_renaming(directory: str, name: str) -> None:
    source = os.path.join(directory, name)
    if not os.path.lexists(source):
        return
    aside = os.path.join(directory, STAGING_DIR, f"{name}{DELETING_MARK}{uuid.uuid4().hex[:12]}")
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    os.rename(source, aside)
    shutil.rmtree(aside)
    remove_staging_dir(aside)


def remove_incomplete(root: RootStorage, name: str) -> None:
    """Remove a store that is not a complete checkpoint (the caller knows it is ours and nothing writes it)."""
    root.open(name, read_only=False).remove_all()


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
    # The records are of this package's saves and deletions: of step-N.zarr, never of another name of step N.
    by_step = {s.step: s for s in step_stores(root) if s.name == step_name(s.step)}
    for kind, step in records(root):
        store = by_step.get(step)
        if kind == "deleting":
            removed.append(f"{step_name(step)} (a deletion that was interrupted)")
            if not dry_run:
                delete_step(root, step)  # finishes it, its record last
            continue
        if store is not None and not store.complete:
            removed.append(f"{store.name} (incomplete: its save was interrupted)")
            if not dry_run:
                remove_incomplete(root, store.name)
        if not dry_run:
            remove_record(root, "saving", step)
    return removed
