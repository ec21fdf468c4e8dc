"""The process's staging buffers for ``dcp.async_save``: kept from one save to the next, whichever writer saves.

The line users write, ``dcp.async_save(sd, storage_writer=ZarrWriter(path))``, makes a new writer per checkpoint.
Staging buffers kept by a writer (DCP's ``cache_staged_state_dict``) die with it, so every such save allocated its
host copy anew, and for CUDA tensors pinned it: on an H200, 4.65 s of blocked training per 8.85 GB save against
0.160 s for the copy alone (benchmarks/reports/gpu.md). Here the buffers belong to the process, as torchtitan's
pinned-memory stager and torch_checkpointing's pool keep theirs, keyed by what the state dict holds:

* **One set of buffers per state dict**, named by its tensors' paths; their dtypes, shapes and devices are its
  layout. A save of the same layout copies into the same buffers (DCP's ``StateDictStager``, which reuses a buffer
  per source storage: a model's parameters and its optimizer's state keep theirs from step to step; a state dict
  rebuilt from new tensors at each save, such as ``full_tensor()`` copies, gets new buffers, the old ones freed
  with their sources). A new layout (shapes that changed) releases the old buffers and makes new ones.
* **Pinned for CUDA tensors**, in shared memory (a process-based executor maps it as it is); ordinary memory for
  CPU tensors, which pinning would not speed up.
* **Bounded**: buffers are kept only while the pool holds at most ``limit`` bytes (default: half the machine's
  memory; ``set_staging_memory_limit``). A state dict that would not fit is staged into ordinary memory that is
  freed with its save: memory thrown away is never pinned. Buffers idle longest are released first to make room.
* **Released** by ``release_staging_memory()``, and for one writer's state dict by ``ZarrWriter.close()``.
* **One save at a time per set**: a save that would copy into buffers another save in flight is still writing from
  is refused with an error that says so (``InFlight``).
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch

from dcp_zarr.torch_private import staged_bytes, state_dict_stager

# DCP's thread-based executor ends its thread right after the save's future resolves; a stage asked for in that
# moment waits this long for the thread to go before calling the save still running.
SAVE_THREAD_EXIT_GRACE_S = 1.0


def pinned_staging(devices, cuda_available: bool) -> bool:
    """Whether staging should copy into pinned buffers: only for CUDA tensors (pinning helps device-to-host DMA
    only, and CPU-only builds of torch cannot pin)."""
    return cuda_available and any(device == "cuda" for device in devices)


def tensor_leaves(tree: Any, path: tuple = ()):
    """(path, tensor) of every tensor in a state dict (a DTensor as itself: its ``device`` is its local shard's)."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensor_leaves(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from tensor_leaves(value, (*path, i))


def tensor_devices(tree: Any):
    return (tensor.device.type for _, tensor in tensor_leaves(tree))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: its shard is what is staged
    return to_local() if callable(to_local) else tensor


class InFlight:
    """The staged copy of the last save and the thread running that save: while the thread is alive, or while the
    copy waits for a save that has not started, another stage into the same buffers is refused."""

    def __init__(self) -> None:
        self._staged: weakref.ref | None = None
        self._save_thread: threading.Thread | None = None
        self._copying = False  # a stage is copying into the buffers now

    def copying(self) -> None:
        self._copying = True

    def staged(self, copy) -> None:
        self._staged, self._save_thread, self._copying = weakref.ref(copy), None, False

    def failed(self) -> None:
        self._copying = False

    def save_started(self) -> None:
        if self._save_thread is None and self.pending():
            self._save_thread = threading.current_thread()

    def pending(self) -> bool:
        """A copy is being made, or waits for its save, or its save holds it."""
        return self._copying or (self._staged is not None and self._staged() is not None)

    def refuse(self, what: str, fix: str) -> None:
        if self._copying:
            raise RuntimeError(f"{what} is copying into them now; {fix}")
        thread = self._save_thread
        if thread is not None and thread is not threading.current_thread():  # in its own thread, the save is over
            thread.join(timeout=SAVE_THREAD_EXIT_GRACE_S)  # a save whose future just resolved is still leaving
            if thread.is_alive():
                raise RuntimeError(f"{what} is still running; {fix}")
        if thread is None and self.pending():
            raise RuntimeError(f"{what} has staged its copy but not started yet; {fix}")
        self._staged = self._save_thread = None


class StagedStateDict(dict):
    """A staged copy (a plain dict would not take a weak reference)."""


@dataclass(eq=False)
class Buffers:
    """One state dict's staging buffers."""

    layout: tuple  # (dtype, shape, device type) of each tensor, in path order
    pinned: bool
    kept: bool  # False: freed with its save (over the limit, or not asked to keep)
    stager: Any = None  # DCP's StateDictStager: a buffer per source storage
    nbytes: int = 0
    in_flight: InFlight = field(default_factory=InFlight)

    def stage(self, state_dict: dict) -> StagedStateDict:
        if self.stager is None:
            self.stager = state_dict_stager(self.pinned)
        staged = StagedStateDict(self.stager.stage(state_dict, non_blocking=self.pinned))
        if self.pinned:
            torch.cuda.synchronize()  # non-blocking copies into pinned memory: done before training goes on
        self.nbytes = staged_bytes(self.stager)
        if not self.kept:
            self.release()  # the staged copy keeps its memory until its save lets go of it
        return staged

    def release(self) -> None:
        if self.stager is not None:
            self.stager.close()
        self.stager, self.nbytes = None, 0


class StagingPool:
    """The process's kept staging buffers (the module's ``POOL``)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = _half_of_memory() if limit is None else limit
        self._sets: dict[tuple, Buffers] = {}  # tensor paths -> buffers, least recently staged first
        self._lock = threading.Lock()

    def stage(self, state_dict: dict, keep: bool = True) -> tuple[StagedStateDict, Buffers]:
        """A host copy of ``state_dict``, in kept buffers where ``keep`` and the limit allow, and those buffers."""
        leaves = list(tensor_leaves(state_dict))
        paths = tuple(path for path, _ in leaves)
        locals_ = [_local(t) for _, t in leaves]
        layout = tuple((t.dtype, tuple(t.shape), t.device.type) for t in locals_)
        pinned = pinned_staging((t.device.type for t in locals_), torch.cuda.is_available())
        with self._lock:
            buffers = self._sets.get(paths) if keep else None
            if buffers is not None:
                buffers.in_flight.refuse("an async save staged into the buffers this one would copy into",
                                         "wait for its future before the next dcp.async_save of this state dict")
                del self._sets[paths]
                if buffers.layout != layout or buffers.pinned != pinned:  # shapes changed: new buffers
                    buffers.release()
                    buffers = None
            if buffers is None:
                needed = sum(t.numel() * t.element_size() for t in locals_)
                fits = keep and self._make_room(needed)
                buffers = Buffers(layout, pinned=pinned and fits, kept=fits)
            if buffers.kept:
                self._sets[paths] = buffers  # most recently staged last
            buffers.in_flight.copying()
        try:
            staged = buffers.stage(state_dict)
        except BaseException:
            buffers.in_flight.failed()
            raise
        buffers.in_flight.staged(staged)
        return staged, buffers

    def give_away(self, buffers: Buffers) -> None:
        """Forget ``buffers`` without reusing them: their staged copy went to another process (the process-based
        executor), which writes from them while this one may stage again."""
        with self._lock:
            for paths, kept in list(self._sets.items()):
                if kept is buffers:
                    del self._sets[paths]
        buffers.release()

    def release(self, buffers: Buffers | None = None) -> int:
        """Release ``buffers``, or every idle set of buffers; returns the bytes released. Buffers a save in flight
        is writing from are kept until it ends (releasing them then is the caller's to ask again)."""
        released = 0
        with self._lock:
            for paths, kept in list(self._sets.items()):
                if (buffers is None or kept is buffers) and not kept.in_flight.pending():
                    released += kept.nbytes
                    kept.release()
                    del self._sets[paths]
        return released

    def held(self) -> int:
        """Bytes of host memory the pool keeps between saves."""
        with self._lock:
            return sum(buffers.nbytes for buffers in self._sets.values())

    def _make_room(self, needed: int) -> bool:
        """Release idle buffers, least recently staged first, until ``needed`` more bytes fit under the limit;
        whether they do."""
        if needed > self.limit:
            return False
        held = sum(buffers.nbytes for buffers in self._sets.values())
        for paths, buffers in list(self._sets.items()):
            if held + needed <= self.limit:
                break
            if not buffers.in_flight.pending():
                held -= buffers.nbytes
                buffers.release()
                del self._sets[paths]
        return held + needed <= self.limit


def _half_of_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # no sysconf: 16 GiB
        return 16 << 30


POOL = StagingPool()


def release_staging_memory() -> int:
    """Release the host memory ``dcp.async_save`` keeps for the next save (pinned buffers included); returns the
    bytes released. The next async save allocates again."""
    return POOL.release()


def set_staging_memory_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of staging buffers between async saves (default: half the machine's memory); idle
    buffers beyond it are released now. A state dict larger than the limit is staged into memory freed with its
    save, never pinned."""
    if type(nbytes) is not int or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: expected a number of bytes >= 0")
    with POOL._lock:
        POOL.limit = nbytes
        POOL._make_room(0)


def staging_memory_held() -> int:
    """Bytes of host memory kept between async saves for the next one."""
    return POOL.held()
