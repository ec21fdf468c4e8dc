"""The staging copy of ``dcp.async_save``: what the caller waits for before training goes on.

``ZarrWriter`` is DCP's ``AsyncStager`` for its own saves (``dcp.async_save`` uses a writer that is one when no
``async_stager`` is passed). The copying is DCP's own ``DefaultStager``, blocking: when any tensor is on a CUDA
device, every copy goes into pinned (page-locked) shared host memory, which the GPU fills by DMA and a process-based
executor can map as it is; otherwise into ordinary memory, as DCP's default stager does.

By default each save stages into new buffers, freed when that save is done. With ``cache_staged_state_dict=True``
the writer keeps them and the next save copies into the same buffers (no allocation, no pinning): keep one writer
and pass ``checkpoint_id=`` per save.

One writer runs one save at a time. The writer keeps a weak reference to the copy it staged and notes the thread
that runs its save (DCP's thread-based executor starts one per save, which ends with it): while that thread is alive,
or while the copy waits for a save that has not started, the writer refuses to stage again. The process-based
executor takes the staged copy to another process, where this writer cannot see it: there the buffers go with it
(a writer pickled with a pending save forgets its kept buffers), and waiting for each future is the caller's part.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

# DCP's thread-based executor ends its thread right after the save's future resolves; a writer asked to stage in
# that moment waits this long for the thread to go before calling the save still running.
SAVE_THREAD_EXIT_GRACE_S = 1.0


def pinned_staging(devices: Iterable[str], cuda_available: bool) -> bool:
    """Whether staging should copy into pinned buffers: only for CUDA tensors (pinning helps device-to-host DMA
    only, and CPU-only builds of torch cannot pin)."""
    return cuda_available and any(device == "cuda" for device in devices)


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a state dict (a DTensor's ``device`` is its local shard's)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors(value)


def tensor_devices(tree: Any) -> Iterator[str]:
    return (tensor.device.type for tensor in tensors(tree))


def _stager(pinned: bool) -> DefaultStager:
    # Pinned buffers are also shared memory: the process-based executor pickles the staged copy, which would move
    # ordinary memory (and its CUDA registration) into a new shared block; shared memory is sent as it is.
    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=pinned, use_async_staging=False,
                                        use_non_blocking_copy=pinned))


class _StagedStateDict(dict):
    """A staged copy (a plain dict would not take a weak reference)."""


class WriterStaging(AsyncStager):
    """``AsyncStager`` half of ``ZarrWriter``: a blocking copy, into buffers kept for the next save if asked to."""

    _synchronize_after_execute = False  # stage() returns only when the copy is complete

    def __init__(self, cache_staged_state_dict: bool = False) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self._stager: DefaultStager | None = None
        self._pinned: bool | None = None
        self._staged: weakref.ref | None = None  # the last staged copy; dead once its save (or failure) lets go
        self._save_thread: threading.Thread | None = None  # the thread running the save of that copy

    def stage(self, state_dict: dict) -> dict:
        self._refuse_while_saving()
        pinned = pinned_staging(tensor_devices(state_dict), torch.cuda.is_available())
        if not self.cache_staged_state_dict:
            stager = _stager(pinned)
            try:
                staged = stager.stage(state_dict)
            finally:
                stager.close()  # drops only the stager's cache: the staged copy lives as long as its save holds it
        else:
            if self._stager is None or pinned != self._pinned:
                self.close()
                self._stager, self._pinned = _stager(pinned), pinned
            staged = self._stager.stage(state_dict)
        assert isinstance(staged, dict)  # a Future only with use_async_staging, which _stager never sets
        staged = _StagedStateDict(staged)
        self._save_thread, self._staged = None, weakref.ref(staged)
        return staged

    def save_started(self) -> None:
        """Called by the writer when a save starts, in the thread that runs it."""
        if self._save_thread is None and self._pending():
            self._save_thread = threading.current_thread()

    def synchronize_staging(self) -> None:
        pass  # stage() already waited for its copies

    def close(self) -> None:
        """Release the kept staging buffers (pinned ones included); the next async save allocates new ones."""
        if self._stager is not None:
            self._stager.close()
        self._stager = None
        self._pinned = None

    def _pending(self) -> bool:
        return self._staged is not None and self._staged() is not None

    def _refuse_while_saving(self) -> None:
        # A second save would take over the first one's paths and, with kept buffers, overwrite the data the first is
        # still writing from.
        thread = self._save_thread
        if thread is not None and thread is not threading.current_thread():  # in its own thread, the save is over
            thread.join(timeout=SAVE_THREAD_EXIT_GRACE_S)  # a save whose future just resolved is still leaving
            if thread.is_alive():
                raise RuntimeError(
                    "ZarrWriter: the previous async save with this writer is still running; wait for its future "
                    "before the next dcp.async_save, or use another writer")
        if thread is None and self._pending():
            raise RuntimeError(
                "ZarrWriter: the previous async save with this writer has staged its copy but not started yet; wait "
                "for its future before the next dcp.async_save, or use another writer")
        self._save_thread = self._staged = None

    def __getstate__(self) -> dict:
        if self._save_thread is None and self._pending():
            # The process-based executor is sending the staged copy (buffers included) to its worker: they are the
            # worker's now, and this writer must not copy into them again.
            self.close()
        state = self.__dict__.copy()
        state.update(_stager=None, _pinned=None, _staged=None, _save_thread=None)
        return state
