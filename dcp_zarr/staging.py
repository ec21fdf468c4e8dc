"""The staging copy of ``dcp.async_save``: what the caller waits for before training goes on.

``ZarrWriter`` is DCP's ``AsyncStager`` for its own saves (``dcp.async_save`` uses a writer that is one when no
``async_stager`` is passed). CUDA tensors are copied into pinned (page-locked) host buffers, which the GPU fills by
DMA, with non-blocking copies waited for before the call returns; CPU tensors are copied to ordinary memory, as DCP's
default stager does. The copying is DCP's own ``DefaultStager``, kept by the writer: a writer reused for the next
save (``checkpoint_id=`` per save) copies into the same buffers again instead of allocating and pinning new ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions


def pinned_staging(devices: Iterable[str], cuda_available: bool) -> bool:
    """Whether staging should copy into pinned buffers: only for CUDA tensors (pinning helps device-to-host DMA
    only, and CPU-only builds of torch cannot pin)."""
    return cuda_available and "cuda" in set(devices)


def tensor_devices(tree: Any) -> Iterator[str]:
    """The device types of every tensor in a state dict (a DTensor's local shard counts)."""
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        yield local.device.type
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensor_devices(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensor_devices(value)


class WriterStaging(AsyncStager):
    """``AsyncStager`` half of ``ZarrWriter``: a blocking copy, into buffers kept for the writer's next save."""

    _synchronize_after_execute = False  # stage() returns only when the copy is complete

    def __init__(self) -> None:
        self._stager: DefaultStager | None = None
        self._pinned: bool | None = None

    def stage(self, state_dict: dict) -> dict:
        pinned = pinned_staging(tensor_devices(state_dict), torch.cuda.is_available())
        if self._stager is None or pinned != self._pinned:
            self.close()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=pinned))
            self._pinned = pinned
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        pass  # stage() already waited for its copies

    def close(self) -> None:
        """Release the staging buffers (pinned ones included); the next async save allocates new ones."""
        if self._stager is not None:
            self._stager.close()
        self._stager = None
        self._pinned = None

    def __getstate__(self) -> dict:
        # The process-based async executor pickles the writer into its worker; staging buffers stay here.
        state = self.__dict__.copy()
        state.update(_stager=None, _pinned=None)
        return state
