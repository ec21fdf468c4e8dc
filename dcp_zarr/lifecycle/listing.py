"""What a root holds: its step stores (every name of a form in step_forms.py, with its state), and what saves and
deletions that stopped left in its staging directory."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dcp_zarr.lifecycle.root_storage import RootStorage
from dcp_zarr.lifecycle.step_forms import StepState, form_of, parse_step, step_name
from dcp_zarr.store_io.commit import LEGACY_STAGING_MARK, STAGING_DIR, STAGING_MARK

DELETING_MARK = ".deleting-"  # <name>.deleting-<id>, in STAGING_DIR: a local store being deleted
_STAGED = re.compile(r"^(?P<name>.+?)(" + re.escape(STAGING_MARK) + "|" + re.escape(DELETING_MARK) + r")[0-9a-f]+$")
# What versions before 0.2 left beside the stores: .step-N.zarr.dcp-zarr-partial-*, .step-N.zarr.dcp-zarr-deleting-*
_LEGACY_LEFTOVER = re.compile(r"^\.(step-\d+\.zarr)(" + re.escape(LEGACY_STAGING_MARK) + r"|\.dcp-zarr-deleting-)")


@dataclass(frozen=True)
class StepStore:
    step: int
    name: str
    complete: bool
    other_format: str | None = None  # what it is instead, when it is a step folder of another format
    folder: bool = False  # a folder of several stores (accelerate's checkpoint_N), not one store


def step_stores(root: RootStorage, known_complete: frozenset[str] = frozenset()) -> list[StepStore]:
    """Every step store under ``root``, ascending by step, with its state; of two names of one step, this
    package's ``step-N.zarr`` last. ``known_complete``: names the caller committed itself and nobody else may change
    (a manager holding the root's lease), taken as complete without reading their root zarr.json (some ms each, on a
    disk, for a store of a few hundred arrays; a request each on an object store)."""
    found = []
    for name in root.names():
        form = form_of(name)
        if form is not None:
            state = StepState(True) if name in known_complete else form[0].state(root, name)
            found.append(StepStore(form[1], name, state.complete, state.other_format, state.folder))
    return sorted(found, key=lambda s: (s.step, s.name == step_name(s.step)))


def leftovers(root: RootStorage) -> list[str]:
    """The staging and deleting directories of step stores (``.dcp-zarr-staging/step-N.zarr.partial-*``, and the
    ``.step-N.zarr.dcp-zarr-partial-*`` that versions before 0.2 left beside the stores), relative to the root.
    Only a storage that commits by renaming a staged directory has them: object stores are written in place."""
    if not root.storage.commits_by_rename:
        return []
    staged = []
    for name in root.names(STAGING_DIR):
        match = _STAGED.match(name)
        if match and parse_step(match.group("name")) is not None:
            staged.append(f"{STAGING_DIR}/{name}")
    return staged + [name for name in root.names() if _LEGACY_LEFTOVER.match(name)]
