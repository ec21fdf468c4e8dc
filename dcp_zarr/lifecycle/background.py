"""Retention's deletions off the caller's thread: one deletion at a time, in the order asked, on a thread of their own,
so that a training loop's ``save()`` waits for its save only (a LoRA run waited 2-4 s a save for the ~1,000 files of
the step retention dropped).

Each deletion is the crash-safe one of deletion.py (renamed aside, or recorded first on an object store), so a
process killed in the middle leaves what the next manager finishes, as before. A failed deletion is kept and raised,
naming the step and the root, at the next ``raise_failure`` (the manager's next ``save()``, ``wait()`` or
``close()``); the deletions after it still run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from dcp_zarr.errors import ZarrCheckpointError
from dcp_zarr.lifecycle.deletion import finish_deletions, interrupted_deletions
from dcp_zarr.lifecycle.root_storage import RootStorage


class BackgroundDeletions:
    """The steps being deleted under ``root``, and the one thread that deletes them."""

    def __init__(self, root: RootStorage, delete: Callable[[int, str], None]):
        self.root = root
        self._delete = delete
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self._failures: list[tuple[int, str, BaseException]] = []

    def pending(self) -> set[int]:
        """The steps asked to be deleted whose deletion has not finished: no longer the manager's to list or load."""
        with self._lock:
            return set(self._pending)

    def submit(self, step: int, name: str, check: Callable[[], None]) -> None:
        """Delete step ``step``'s store ``name`` after those asked before it; ``check()`` first (the lease)."""
        with self._lock:
            if step in self._pending:
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-zarr-retention")
            self._pending[step] = self._executor.submit(self._run, step, name, check)

    def _run(self, step: int, name: str, check: Callable[[], None]) -> None:
        try:
            check()
            self._delete(step, name)
        except BaseException as exc:  # kept for the caller's thread: nothing else would ever see it
            with self._lock:
                self._failures.append((step, name, exc))
        finally:
            with self._lock:
                self._pending.pop(step, None)

    def join(self) -> None:
        """Wait for every deletion asked so far."""
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:
            future.result()

    def raise_failure(self) -> None:
        """Raise the first deletion that failed since the last call (the others are named in its message)."""
        error = self.take_failure()
        if error is not None:
            raise error

    def take_failure(self) -> ZarrCheckpointError | None:
        """The error ``raise_failure`` would raise now, or None; either way the failures so far are taken."""
        with self._lock:
            failures, self._failures = self._failures, []
        if not failures:
            return None
        step, name, exc = failures[0]
        more = f" (and {len(failures) - 1} more: {', '.join(_named(*f[:2]) for f in failures[1:])})" \
            if len(failures) > 1 else ""
        error = ZarrCheckpointError(
            f"{self.root.url}: retention could not delete {_named(step, name)}{more}: {type(exc).__name__}: {exc}; "
            "the next manager on this root finishes an interrupted deletion")
        error.__cause__ = exc
        return error

    def close(self) -> None:
        """Wait for the deletions, then stop the thread."""
        self.join()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def _named(step: int, name: str) -> str:
    """A deletion as its error names it: ``step N (name)``, or the name alone where the key is not a step (a negative
    number: a Lightning checkpoint whose name holds none)."""
    return f"step {step} ({name})" if step >= 0 else name


def finishing_first(root: RootStorage, delete: Callable[[int, str], None]) -> Callable[[int, str], None]:
    """``delete``, whose first call first finishes the deletions that a killed process had left under ``root`` when
    this was called (``deletion.finish_deletions``): for the frameworks' adapters, which hold no lease and clean
    nothing up as they start, so that a job killed in a deletion leaves nothing the next one does not remove. Call it
    before renaming anything aside: what is found now is what is finished."""
    interrupted = [interrupted_deletions(root)]

    def delete_after_finishing(step: int, name: str) -> None:
        if interrupted:
            finish_deletions(root, interrupted.pop())
        delete(step, name)

    return delete_after_finishing
