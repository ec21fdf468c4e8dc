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

Step stores are also recognized under the names training frameworks give them (step_forms.py), so ``dcp-zarr
list`` and ``prune`` work on their checkpoint folders; a manager saves under its own ``step-N.zarr`` names, and
lists, loads and deletes only single stores.

``CheckpointRoot`` is the one object the manager, the lease and the command line hold; each job is a module of its
own: the names (step_forms.py), what is there (listing.py), the records (records.py), deletion (deletion.py) and
retention (retention.py), over the root's storage (root_storage.py).
"""

from __future__ import annotations

from dcp_zarr.lifecycle import deletion, listing, records, step_forms
from dcp_zarr.lifecycle.root_storage import RootStorage
from dcp_zarr.store_io.root_document import holds_dcp_checkpoint, is_committed


class CheckpointRoot(RootStorage):
    """Listing, records and crash-safe deletion under ``root`` (a local directory or an fsspec URL)."""

    # -- what is there -------------------------------------------------------------------------------------------------

    def step_stores(self, known_complete: frozenset[str] = frozenset()) -> list[listing.StepStore]:
        """Every step store under the root (``STEP_NAME_FORMS``), ascending by step, with whether it is a complete
        checkpoint; of two names of one step, this package's ``step-N.zarr`` last. ``known_complete``: names the
        caller committed under the root's lease, not read again (listing.step_stores)."""
        return listing.step_stores(self, known_complete)

    def leftovers(self) -> list[str]:
        """Staging and deleting directories of step stores that stopped saves and deletions left, relative to the
        root."""
        return listing.leftovers(self)

    def is_complete(self, name: str) -> bool:
        """Whether ``name`` holds a committed dcp_zarr checkpoint."""
        return is_committed(self.open(name))

    def holds_dcp_checkpoint(self, name: str) -> bool:
        """Whether ``name`` is a checkpoint DCP's FileSystemWriter wrote (its ``.metadata``)."""
        return holds_dcp_checkpoint(self.open(name))

    def other_format(self, name: str) -> str | None:
        """What other format's checkpoint ``name`` holds (step_forms.other_format), or None."""
        return step_forms.other_format(self.open(name))

    # -- records -------------------------------------------------------------------------------------------------------

    def records(self) -> list[tuple[str, int]]:
        """``("saving" | "deleting", step)`` for every record in ``.dcp-zarr/``."""
        return records.records(self)

    def write_record(self, kind: str, step: int, document: dict) -> None:
        records.write_record(self, kind, step, document)

    def remove_record(self, kind: str, step: int) -> None:
        records.remove_record(self, kind, step)

    def remove_empty_records_folder(self) -> None:
        records.remove_empty_records_folder(self)

    # -- removing ------------------------------------------------------------------------------------------------------

    def delete_step(self, step: int, name: str | None = None) -> None:
        """Delete ``step-N.zarr`` (or ``name``, another form's) so that no crash leaves it looking complete."""
        deletion.delete_step(self, step, name)

    def clean_leftovers(self, *, dry_run: bool = False) -> list[str]:
        """Remove what stopped saves and deletions left behind; returns what it removed (or would remove)."""
        return deletion.clean_leftovers(self, dry_run=dry_run)
