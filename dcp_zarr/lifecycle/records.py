"""A root's own records, in ``.dcp-zarr/``: ``saving-N.json`` (a save of step N was started: on an object store,
written in place, only this says an incomplete ``step-N.zarr`` is ours) and ``deleting-N.json`` (a deletion of step
N was started on an object store). The lease is there too (lease.py)."""

from __future__ import annotations

import re

from dcp_zarr.lifecycle.root_storage import RootStorage
from dcp_zarr.lifecycle.step_forms import ACCELERATE, STEP_DIGITS

RECORDS = ".dcp-zarr"
_RECORD = re.compile(r"^(saving|deleting)-(\d+)\.json$")


def record_key(kind: str, step: int) -> str:
    return f"{RECORDS}/{kind}-{step:0{STEP_DIGITS}d}.json"


def records(root: RootStorage) -> list[tuple[str, int]]:
    """``("saving" | "deleting", step)`` for every record of ``root``."""
    found = []
    for name in root.names(RECORDS):
        match = _RECORD.match(name)
        if match:
            found.append((match.group(1), int(match.group(2))))
    return found


def write_record(root: RootStorage, kind: str, step: int, document: dict) -> None:
    root.write_json(record_key(kind, step), document)


def remove_record(root: RootStorage, kind: str, step: int) -> None:
    root.remove_key(record_key(kind, step))


def remove_empty_records_folder(root: RootStorage) -> None:
    """Remove ``.dcp-zarr/`` if it is empty and the root holds accelerate's ``checkpoint_N`` folders: accelerate's
    ``total_limit`` takes every entry of that folder for a checkpoint and fails on a name without a number."""
    if any(ACCELERATE.step(name) is not None for name in root.names()):
        root.remove_empty_directory(RECORDS)
