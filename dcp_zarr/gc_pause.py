"""Python's cyclic garbage collector paused: while a JSON document is decoded, and while a save's or load's own
steps run on the main thread.

A step of a save makes and keeps tens of objects per entry (write items, layouts, jobs, documents) until it ends;
with thousands of entries they outlive young collections and set off full ones, each a walk over every object the
process holds (the model, torch's modules): a large share of a save of thousands of small tensors. With these steps
paused a save sets off none, and training code between saves meets fewer, not more, so the work is avoided, not
moved (measured in benchmarks/reports/performance.md, "The plain line and per-entry cost"). The objects
need no collector: reference counting frees them when the step ends.

``gc.disable`` is process-wide. A decode takes milliseconds and pauses it on any thread; a step may take seconds, so
only the main thread pauses it for one: a save on a background thread (DCP's async saves) leaves the collector to
the training loop. The transfers of ``write_data`` and ``read_data`` pause it only for a local file system, whose IO
threads are dcp_zarr's own and make no reference cycles; an object store's client, for the minutes a transfer may
take, keeps its collections. Pauses that overlap (threads, nested steps) count: the collector is turned off by the
first and restored by the last, as it was before the first. A collector the caller turned off stays off.

Implementation.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_pauses = 0  # pauses under way, on every thread
_enabled_before = False  # the collector's state when the first of them began


def _after_fork_in_child() -> None:
    """A process forked while a pause was under way has none of the threads that would end it: the collector is
    restored there, and the lock (held, perhaps, by a thread that is not there) made anew."""
    global _lock, _pauses
    _lock = threading.Lock()
    if _pauses:
        _pauses = 0
        if _enabled_before:
            gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside (restored as it was after, if it was on), on whichever thread."""
    global _pauses, _enabled_before
    with _lock:
        if _pauses == 0:
            _enabled_before = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _enabled_before:
                gc.enable()


@contextlib.contextmanager
def paused_on_main_thread(pause: bool = True) -> Iterator[None]:
    """``collector_paused`` when ``pause`` and this is the main thread; else nothing."""
    if not pause or threading.current_thread() is not threading.main_thread():
        yield
        return
    with collector_paused():
        yield


def step_with_collector_paused(step: Callable[_P, _R]) -> Callable[_P, _R]:
    """``step`` run with the cyclic collector paused when called on the main thread with the collector on."""

    @functools.wraps(step)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with paused_on_main_thread():
            return step(*args, **kwargs)

    return paused
