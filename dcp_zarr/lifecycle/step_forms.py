"""The names a step's checkpoint goes by under a root, one entry per form: what step a name is, what state the
checkpoint under it is in, and how to delete it so that no crash leaves it looking complete.

* ``step-N.zarr``: this package's ``CheckpointManager`` (``step_name``, padded); one store.
* ``step-N``: torchtitan's ``CheckpointManager`` (``_create_checkpoint_id``); one store.
* ``epoch=E-step=N[.ckpt]``: Lightning's ``ModelCheckpoint`` default, a store a DCP strategy writes.
* ``checkpoint_N``: accelerate's ``automatic_checkpoint_naming`` (its N counts saves, not training steps); a folder
  of stores and accelerate's own files (folders.py).

A framework adapter whose framework names its step folders another way adds its form to ``STEP_FORMS``; ``dcp-zarr
list`` and ``prune`` then see its checkpoints. Only names of these forms are ever removed, so foreign files beside
the stores are never touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dcp_zarr.errors import ZarrCheckpointError
from dcp_zarr.format.manifest import ROOT_KEY
from dcp_zarr.lifecycle.folders import FINISHED_MARK, FOLDER_NAME, folder_state
from dcp_zarr.lifecycle.root_storage import RootStorage
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.root_document import holds_dcp_checkpoint, is_committed

STEP_DIGITS = 8
DCP_CHECKPOINT = "a DCP checkpoint (FileSystemWriter)"
SAFETENSORS = "Hugging Face safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"  # what marks a folder as Hugging Face safetensors
ACCELERATES_OWN = "DCP checkpoints accelerate wrote itself"


def step_name(step: int) -> str:
    """``step-00000042.zarr``: names sort by step up to 10**8 (larger steps still parse)."""
    return f"step-{step:0{STEP_DIGITS}d}.zarr"


@dataclass(frozen=True)
class StepState:
    """What listing needs of a step's checkpoint."""

    complete: bool  # loadable: committed (every store of a folder, and the folder finished)
    other_format: str | None = None  # what it is instead, when it is a step folder of another format
    folder: bool = False  # a folder of several stores (accelerate's checkpoint_N), not one store


def other_format(storage: Storage) -> str | None:
    """What other format's checkpoint ``storage`` holds (a DCP checkpoint, Hugging Face safetensors), by the file
    that format writes; None if none. A committed store's folder can hold one too: a run that switched back to
    DCP's own checkpointing writes DCP's files into the step folders it finds."""
    if holds_dcp_checkpoint(storage):
        return DCP_CHECKPOINT
    try:
        return SAFETENSORS if storage.exists(SAFETENSORS_INDEX) else None
    except (ZarrCheckpointError, OSError):
        return None


@dataclass(frozen=True)
class StepForm:
    """One form of name: a single store, its step the pattern's one group."""

    shape: str  # as `dcp-zarr list` names it
    pattern: re.Pattern[str]
    # What a deletion removes first, so that a crash partway leaves it incomplete: the commit marker(s).
    commit_marks: tuple[str, ...] = (ROOT_KEY,)

    def step(self, name: str) -> int | None:
        match = self.pattern.match(name)
        return int(match.group(1)) if match else None

    def state(self, root: RootStorage, name: str) -> StepState:
        storage = root.open(name)
        if is_committed(storage):
            return StepState(True)
        return StepState(False, other_format(storage))

    def delete(self, root: RootStorage, name: str) -> None:
        """Remove ``name`` whole, its commit marks first (the rest in any order, as an object store deletes)."""
        storage = root.open(name, read_only=False)
        for mark in self.commit_marks:
            storage.remove(mark)
        storage.remove_all()


@dataclass(frozen=True)
class FolderForm(StepForm):
    """accelerate's ``checkpoint_N``: a folder of stores, complete when they all are and accelerate finished it
    (folders.py); one that is itself a committed store counts as that store."""

    def state(self, root: RootStorage, name: str) -> StepState:
        if is_committed(root.open(name)):
            return StepState(True)
        folder = folder_state(root, name)
        only_dcp = bool(folder.dcp) and not folder.committed
        return StepState(folder.complete and not only_dcp, ACCELERATES_OWN if only_dcp else None, folder=True)


OURS = StepForm("step-N.zarr", re.compile(r"^step-(\d+)\.zarr$"))
TORCHTITAN = StepForm("step-N", re.compile(r"^step-(\d+)$"))
LIGHTNING = StepForm("epoch=E-step=N[.ckpt]", re.compile(r"^epoch=\d+-step=(\d+)(?:\.ckpt)?$"))
ACCELERATE = FolderForm("checkpoint_N", FOLDER_NAME, commit_marks=(ROOT_KEY, FINISHED_MARK))
STEP_FORMS = (OURS, TORCHTITAN, LIGHTNING, ACCELERATE)
STEP_NAME_FORMS = tuple(form.shape for form in STEP_FORMS)


def form_of(name: str) -> tuple[StepForm, int] | None:
    """The form ``name`` has and its step, or None for a name of no form (never listed, never removed)."""
    for form in STEP_FORMS:
        step = form.step(name)
        if step is not None:
            return form, step
    return None


def parse_step(name: str) -> int | None:
    """The step of a step store's name (``STEP_NAME_FORMS``), else None."""
    found = form_of(name)
    return found[1] if found else None
