"""The staging copy of ``dcp.async_save``: what the caller waits for before training goes on.

``ZarrWriter`` is DCP's ``AsyncStager`` for its own saves (``dcp.async_save`` uses a writer that is one when no
``async_stager`` is passed). The copy is blocking, into the process's staging pool (pool.py): buffers kept from one
save to the next by default, even when each save has a new writer (the line users write), pinned for CUDA tensors;
``cache_staged_state_dict=False`` stages into memory freed with its save instead.

One writer runs one save at a time (``InFlight``: the copy it staged, and the thread that runs its save; DCP's
thread-based executor starts one per save, which ends with it). The process-based executor takes the staged copy
to another process, where this one cannot see it: there the buffers go with it (a writer pickled with a pending save
gives them away, and the pool makes new ones), and waiting for each future is the caller's part.
"""

from __future__ import annotations

from typing import Any

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.staging import AsyncStager

from dcp_zarr.staging.pool import POOL, Buffers, InFlight

_FIX = "wait for its future before the next dcp.async_save, or use another writer"


class WriterStaging(AsyncStager):
    """``AsyncStager`` half of ``ZarrWriter``: a blocking copy into the staging pool."""

    _synchronize_after_execute = False  # stage() returns only when the copy is complete

    def __init__(self, cache_staged_state_dict: bool | None = None) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self._buffers: Buffers | None = None  # where this writer's last save was staged
        self._in_flight = InFlight()

    def stage(self, state_dict: dict) -> dict:
        self._in_flight.refuse("ZarrWriter: the previous async save with this writer", _FIX)
        staged, self._buffers = POOL.stage(state_dict, keep=self.cache_staged_state_dict is not False)
        self._in_flight.staged(staged)
        return staged

    def save_started(self) -> None:
        """Called by the writer when a save starts, in the thread that runs it."""
        self._in_flight.save_started()
        if self._buffers is not None:
            self._buffers.in_flight.save_started()

    def synchronize_staging(self) -> None:
        pass  # stage() already waited for its copies

    def close(self) -> None:
        """Release the staging buffers of this writer's last save (pinned ones included); the next async save of
        that state dict allocates new ones. ``dcp_zarr.release_staging_memory()`` releases every idle set."""
        if self._buffers is not None:
            POOL.release(self._buffers)
        self._buffers = None

    def __getstate__(self) -> dict[str, Any]:
        if self._in_flight.pending() and self._buffers is not None:
            # The process-based executor is sending the staged copy (buffers included) to its worker: they are the
            # worker's now, and no save in this process may copy into them again.
            POOL.give_away(self._buffers)
        state = self.__dict__.copy()
        state.update(_buffers=None, _in_flight=InFlight())
        return state
