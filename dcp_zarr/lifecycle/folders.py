"""Checkpoint folders of several stores: accelerate's ``checkpoints/checkpoint_N``.

::

    checkpoints/checkpoint_10/
      pytorch_model_fsdp_0/                          a store (the model), committed once its zarr.json is there
      optimizer_0/                                   a store (its optimizer)
      .dcp-zarr-staging/optimizer_0.partial-*        a store being written, or what a killed save left
      random_states_0.pkl, random_states_1.pkl, ...  accelerate's own files, one per rank

accelerate makes ``checkpoint_N`` before writing into it, then writes the models' stores, the optimizers' stores, and
its own files, so a save killed at any moment leaves a folder under the next number holding part of a checkpoint. A
folder is complete when every store in it (and every one the caller expects) is committed and ``random_states_0.pkl``
is there: rank 0 writes that file only once every store of the save is committed (``save_accelerator_state``, after
the collective saves), so a folder without it stopped before the end, even if the stores it holds are whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from dcp_zarr.lifecycle.root_storage import RootStorage
from dcp_zarr.store_io.commit import STAGING_DIR, STAGING_MARK
from dcp_zarr.store_io.root_document import holds_dcp_checkpoint, is_committed

FOLDER_NAME = re.compile(r"^checkpoint_(\d+)$")  # accelerate's automatic_checkpoint_naming
# accelerate's FSDP_MODEL_NAME and OPTIMIZER_NAME, numbered: the stores a ZarrAccelerator writes (its adapter names
# the ones it expects; this is for the command line, which cannot ask accelerate)
_STORE_NAME = re.compile(r"^(pytorch_model_fsdp|optimizer)_\d+$")
FINISHED_MARK = "random_states_0.pkl"


@dataclass(frozen=True)
class FolderState:
    """What one ``checkpoint_N`` holds: its stores by state, and whether accelerate finished writing it."""

    name: str
    number: int
    committed: tuple[str, ...] = ()  # dcp_zarr stores, committed
    dcp: tuple[str, ...] = ()  # DCP directories (.metadata): accelerate's own saves, before a switch to dcp_zarr
    unfinished: tuple[str, ...] = ()  # stores started and never committed (a staging area, or no commit marker)
    missing: tuple[str, ...] = ()  # stores the caller expects that are not there at all
    finished: bool = False  # FINISHED_MARK is there

    @property
    def complete(self) -> bool:
        """Loadable: some store, each committed (or accelerate's own DCP directory), none expected missing, and
        accelerate got to the end of the save."""
        return bool(self.committed or self.dcp) and not self.unfinished and not self.missing and self.finished

    def why_incomplete(self) -> str:
        """What is wrong with it, in words ("" when complete)."""
        why = [f"{name} was never committed" for name in self.unfinished]
        why += [f"{name} is missing" for name in self.missing]
        if not (self.committed or self.dcp or self.unfinished or self.missing):
            why.append("it holds no store")
        if not self.finished:
            why.append(f"{FINISHED_MARK}, which accelerate writes after every store of a save, is missing")
        return "; ".join(why)


def checkpoint_folders(root: RootStorage, expected: Iterable[str] = ()) -> list[FolderState]:
    """Every ``checkpoint_N`` directly under ``root``, ascending by N; ``expected``: the stores each must hold."""
    numbered = [(int(match.group(1)), name) for name in root.names() if (match := FOLDER_NAME.match(name))]
    return [folder_state(root, name, expected) for _, name in sorted(numbered)]


def folder_state(root: RootStorage, name: str, expected: Iterable[str] = ()) -> FolderState:
    """The state of the folder ``name`` of ``root`` (a ``checkpoint_N``)."""
    match = FOLDER_NAME.match(name)
    assert match, f"{name} is not a checkpoint_N folder"
    inside = set(root.names(name))
    staged = {entry.split(STAGING_MARK)[0] for entry in root.names(f"{name}/{STAGING_DIR}") if STAGING_MARK in entry}
    expected = set(expected)
    committed, dcp, unfinished = [], [], []
    for store in sorted({n for n in inside if _STORE_NAME.match(n)} | (expected & inside) | staged):
        if store in inside and is_committed(root.open(f"{name}/{store}")):
            committed.append(store)
        elif store in inside and holds_dcp_checkpoint(root.open(f"{name}/{store}")):
            dcp.append(store)
        else:
            unfinished.append(store)
    missing = sorted(expected - inside - staged)
    return FolderState(name, int(match.group(1)), tuple(committed), tuple(dcp), tuple(unfinished), tuple(missing),
                       FINISHED_MARK in inside)
