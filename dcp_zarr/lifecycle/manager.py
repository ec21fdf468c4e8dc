"""``CheckpointManager``: the loop every training job writes around DCP, once.

    mgr = CheckpointManager("ckpts", keep_last=3)
    start = mgr.load(state) + 1 if mgr.latest_step() is not None else 0   # resume at any world size
    for step in range(start, steps):
        train_one_step()
        mgr.save(step, state, async_save=True)                           # blocks only while staging
    mgr.close()

One store per step under ``root`` (lifecycle/root.py). Only complete checkpoints count: a save killed at any
moment is never listed or loaded, the previous one is. Retention runs after a save is complete and never deletes
the newest complete checkpoint, one being written, or one this manager is loading. Rank 0's manager holds the
root's lease (lease.py), so it alone applies retention and removes what killed saves left behind.

Collective: in a process group every rank builds its manager, and calls ``save``, ``load``, ``wait`` and ``close``
together, as with ``dcp.save``/``dcp.load``.

What each complete save did (chunks written, linked and copied over every rank; how long ``save()`` held the caller)
is rank 0's ``last_save`` (save_report.py), and one INFO line of this module's logger there.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_zarr.errors import CheckpointRootBusyError, StepNotFoundError, ZarrCheckpointError
from dcp_zarr.lifecycle.background import BackgroundDeletions
from dcp_zarr.lifecycle.lease import DEFAULT_TIMEOUT_S, Lease
from dcp_zarr.lifecycle.listing import StepStore
from dcp_zarr.lifecycle.rank0 import decided_by_rank0
from dcp_zarr.lifecycle.retention import steps_to_delete
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.lifecycle.save_report import ReportingWriter, SaveReport
from dcp_zarr.lifecycle.step_forms import step_name
from dcp_zarr.optim.load_planner import ZarrLoadPlanner
from dcp_zarr.planning.save_planner import ZarrSavePlanner
from dcp_zarr.reader import ZarrReader
from dcp_zarr.writer import ZarrWriter

logger = logging.getLogger(__name__)


@dataclass
class _Save:
    """A save whose report is to be made once it is complete (an async one: from ``save()`` until it is seen done)."""

    step: int
    writer: ReportingWriter
    blocked_s: float
    future: Future | None = None
    reported: bool = False

    def report(self, path: str, links: bool) -> SaveReport | None:
        """Its report, logged, the first time it is asked for (the caller holds a lock), where its writer was handed
        every rank's write results (rank 0); else None."""
        stored = self.writer.stored_totals
        if self.reported or stored is None:
            return None
        self.reported = True
        report = SaveReport.of(self.step, path, stored, links, self.blocked_s)
        logger.info("dcp_zarr: %s", report)
        return report


class CheckpointManager:
    """Saves, finds, resumes, keeps and cleans the checkpoints of one training job under ``root``.

    Args:
        root: a local directory (created if missing) or an fsspec URL (``s3://bucket/run-7``).
        keep_last: after each complete save, keep only the newest ``keep_last`` complete checkpoints (None: all).
        keep_every: also keep, forever, every checkpoint whose step is a multiple of ``keep_every``.
        storage_options: for fsspec URLs (credentials, ``endpoint_url``, ...).
        reader_options: passed to each ``ZarrReader`` (``safe_globals``, ``thread_count``, ``retry``).
        lease_timeout_s: a manager that stops refreshing its lease for this long is presumed gone (lease.py).
        incremental: each save stores only the chunks that changed since the newest complete checkpoint (its
            ``incremental_from``), the first one in full; every checkpoint still loads on its own, and retention
            deletes any of them without touching the others (docs/incremental.md). Default: full saves.
        **writer_options: passed to each ``ZarrWriter`` (``thread_count``, ``sync_files``, ``overwrite``, ...).
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, keep_every: int | None = None,
                 storage_options: dict | None = None, reader_options: dict | None = None,
                 lease_timeout_s: float = DEFAULT_TIMEOUT_S, incremental: bool = False, **writer_options):
        self.keep_last = _positive_or_none("keep_last", keep_last)
        self.keep_every = _positive_or_none("keep_every", keep_every)
        self.storage_options = storage_options
        self.reader_options = dict(reader_options or {})
        self.writer_options = _checked_writer_options(writer_options, incremental, storage_options)
        self.incremental = incremental
        self.root = CheckpointRoot(root, storage_options, writer_options.get("retry"))
        self._deletions = BackgroundDeletions(self.root, self.root.delete_step)  # retention's, off this thread
        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if self._distributed else 0
        self._lock = threading.Lock()
        self._pending: _Save | None = None  # the async save in flight
        self._last_save: SaveReport | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._in_use: set[int] = set()
        # Step stores this manager committed under its lease: listed as complete without reading them again
        self._committed: set[str] = set()
        self._lease: Lease | None = None
        self._closed = False
        failure = None
        if self._rank == 0:
            try:
                lease = Lease(self.root, timeout_s=lease_timeout_s)
                lease.acquire()
                self._lease = lease
                self.root.clean_leftovers()  # nothing runs here now but what is gone: the lease says so
            except Exception as exc:  # every rank must hear of it, or the others would wait for rank 0 forever
                failure = exc
        message = decided_by_rank0(lambda: None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if message is not None:
            raise CheckpointRootBusyError(f"rank 0's CheckpointManager failed: {message}")

    # -- finding -------------------------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps that have a complete checkpoint, ascending."""
        return [s.step for s in self._step_stores() if s.complete]

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> str:
        """The store of ``step`` (a path, or a URL under an fsspec root); it need not exist."""
        return self.root.location(step_name(_checked_step(step, self.root.url)))

    # -- saving --------------------------------------------------------------------------------------------------------

    @property
    def last_save(self) -> SaveReport | None:
        """What the last complete save did (``SaveReport``), on rank 0, where DCP gathers every rank's write results
        (None elsewhere): a synchronous save's once ``save()`` returns, an async one's once it completes, at the
        latest when ``wait()``, the next ``save()`` or ``close()`` returns."""
        return self._last_save

    def save(self, step: int, state_dict: dict, *, async_save: bool = False):
        """Save ``state_dict`` as ``step``. A save still in flight is waited for first (its error raised here), so
        at most one is ever running. With ``async_save`` this returns once the state is staged, with the Future of
        the rest (``dcp.async_save``'s thread executor, on a process group of its own); else None, once complete
        and retention has run. What it did is ``last_save`` once complete, and logged."""
        started = time.perf_counter()
        self._check_open()
        step = _checked_step(step, self.root.url)
        self._wait_for_save()
        # An earlier deletion's failure, on the rank that deletes: raised once this save is made, which every rank
        # takes part in (raised before it, the other ranks would wait in its collectives until their timeout)
        failed = self._deletions.take_failure()
        self._committed.discard(step_name(step))  # saved again: incomplete until this save commits
        _begin(self._lease, self.root, step, failed)
        writer = ReportingWriter(self.path(step), storage_options=self.storage_options, **self.writer_options,
                                 incremental_from=self._incremental_base(step))
        try:
            if async_save:
                group = self._group_for_async()
                # The planner's process group is DCP's: the background save's own, not the training's.
                future = dcp.async_save(state_dict, storage_writer=writer, process_group=group,
                                        planner=ZarrSavePlanner(process_group=group))
                # a Future: DCP returns an AsyncSaveResponse only for a stager whose stage() returns a Future
                assert isinstance(future, Future)
                pending = self._pending = _Save(step, writer, time.perf_counter() - started, future)
                future.add_done_callback(lambda _: self._report(pending))  # at once, on DCP's thread, if committed
                if failed is not None:
                    raise failed
                return future
            dcp.save(state_dict, storage_writer=writer, planner=ZarrSavePlanner())
        except BaseException as exc:
            self._after_failure()
            if failed is not None:
                exc.add_note(f"also: {failed}")
            raise
        self._after_save(step)
        self._report(_Save(step, writer, time.perf_counter() - started))
        if failed is not None:
            raise failed
        return None

    def wait(self) -> None:
        """Wait for the async save in flight, if any, and raise its error; then for retention's deletions (which run
        in the background), raising the first that failed."""
        try:
            self._wait_for_save()
        finally:
            self._deletions.join()
        self._deletions.raise_failure()

    def _wait_for_save(self) -> None:
        """Wait for the async save in flight, if any; raise its error; then ask retention for its deletions."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        assert pending.future is not None  # an async save's
        try:
            pending.future.result()
        except BaseException:
            self._after_failure()
            raise
        self._report(pending)  # the Future's callback may not have run yet: wait() returns with it made
        self._after_save(pending.step)

    # -- loading -------------------------------------------------------------------------------------------------------

    def load(self, state_dict: dict, step: int | None = None, planner=None) -> int:
        """Load the latest complete checkpoint (or ``step``) into ``state_dict`` in place, at any world size; returns
        the step. ``planner`` defaults to ``ZarrLoadPlanner`` (any optimizer key form loads)."""
        self._check_open()
        if step is not None:
            step = _checked_step(step, self.root.url)
        # Rank 0 looks, every rank loads what it found (a listing elsewhere could race with a save in flight).
        step, name, missing = decided_by_rank0(lambda: _found(self._step_stores(), step, self.root.url))
        if missing:
            raise StepNotFoundError(missing)
        assert step is not None and name is not None  # found: _found gives both
        with self._lock:
            self._in_use.add(step)
        try:
            reader = ZarrReader(self.root.location(name), storage_options=self.storage_options, **self.reader_options)
            dcp.load(state_dict, storage_reader=reader, planner=planner if planner is not None else ZarrLoadPlanner())
        finally:
            with self._lock:
                self._in_use.discard(step)
        return step

    # -- lifecycle -----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the save in flight and retention's deletions, then give up the root's lease. Safe to call twice."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._deletions.close()
            self._closed = True
            if self._lease is not None:
                self._lease.release()
            if self._async_group is not None:
                dist.destroy_process_group(self._async_group)
                self._async_group = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------------------------------

    def _incremental_base(self, step: int) -> str | None:
        """The store an incremental save of ``step`` reuses: the newest complete checkpoint of another step, as rank
        0 sees the root (every rank must pass the same one). Retention never deletes it while this save runs: it
        runs after a save, and keeps the newest complete checkpoint."""
        if not self.incremental:
            return None
        def newest_other() -> str | None:  # the store as listed: a step may be stored under another form's name
            complete = {s.step: s.name for s in self._step_stores() if s.complete and s.step != step}
            return self.root.location(complete[max(complete)]) if complete else None

        return decided_by_rank0(newest_other)

    def _check_open(self) -> None:
        if self._closed:
            raise ZarrCheckpointError(f"CheckpointManager({self.root.url!r}) is closed")

    def _group_for_async(self):
        """DCP's async save runs its collectives on a background thread; on the training's own group they would
        interleave with the training's collectives, so it gets a gloo group of its own (made once, collectively)."""
        if not self._distributed:
            return None
        if self._async_group is None:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)  # every rank is a member: never NON_GROUP_MEMBER
            self._async_group = group
        return self._async_group

    def _report(self, save: _Save) -> None:
        """``last_save`` and its log line for a complete ``save``, once, on rank 0 (``_Save.report``)."""
        with self._lock:
            self._last_save = save.report(self.path(save.step), self.root.directory is not None) or self._last_save

    def _after_save(self, step: int) -> None:
        if self._lease is None:
            return
        self._committed.add(step_name(step))
        self.root.remove_record("saving", step)
        self._apply_retention()

    def _after_failure(self) -> None:
        self._deletions.join()  # what the failed save left is cleaned below: never beside a deletion in flight
        if self._lease is not None:
            self.root.clean_leftovers()  # nothing of this manager's is in flight now: what the failed save left can go

    def _step_stores(self) -> list[StepStore]:
        """The root's step stores; folders of several (accelerate's checkpoint_N) are not a manager's to load."""
        deleting = self._deletions.pending()  # on their way out: never listed, loaded or reused
        stores = self.root.step_stores(frozenset(self._committed))
        return [s for s in stores if not s.folder and s.step not in deleting]

    def _apply_retention(self) -> None:
        complete = {s.step: s.name for s in self._step_stores() if s.complete}
        with self._lock:
            doomed = steps_to_delete(list(complete), self.keep_last, self.keep_every, self._in_use)
        lease = self._lease
        assert lease is not None  # only the manager holding the lease applies retention (_after_save)
        for step in doomed:
            self._committed.discard(complete[step])  # a deletion that fails partway leaves it incomplete
            self._deletions.submit(step, complete[step], lease.check)


def _begin(lease: Lease | None, root: CheckpointRoot, step: int, failed: BaseException | None) -> None:
    """Check the lease and record the save's start, on the rank that holds the lease (rank 0); every rank hears
    whether that failed before any of them enters the save's collectives (a rank raising alone would leave the
    others waiting in them until their timeout). One broadcast a save. ``failed``: an earlier deletion's failure."""
    failure = None
    if lease is not None:
        try:
            lease.check()
            # Object stores are written in place: this record is what marks an incomplete step-N.zarr as ours.
            root.write_record("saving", step, {"step": step, "manager": lease.id, "time": time.time()})
        except Exception as exc:  # noqa: BLE001  (raised below, on every rank)
            failure = exc
    message = decided_by_rank0(lambda: None if failure is None else f"{type(failure).__name__}: {failure}")
    if message is None:
        return
    # the other ranks know rank 0's error by its message: a lost lease keeps its type, anything else is named in it
    kind = CheckpointRootBusyError if message.startswith(CheckpointRootBusyError.__name__) else ZarrCheckpointError
    error = failure or kind(f"rank 0's CheckpointManager could not begin step {step}: {message}")
    if failed is not None:
        error.add_note(f"also: {failed}")
    raise error


def _found(stores: list[StepStore], step: int | None, url: str) -> tuple[int | None, str | None, str | None]:
    """(step, store name, None), or (None, None, why not) for ``step`` (None: the latest complete one) among
    ``stores``, the step stores of the root at ``url``."""
    complete = {s.step: s.name for s in stores if s.complete}
    if step is None:
        if not complete:
            return None, None, f"no complete checkpoint under {url} to load{_seen(stores)}"
        step = max(complete)
    if step not in complete:
        return None, None, (f"{url} has no complete checkpoint of step {step}; complete steps: "
                            f"{', '.join(map(str, sorted(complete))) or 'none'}{_seen(stores)}")
    return step, complete[step], None


def _checked_writer_options(writer_options: dict, incremental, storage_options: dict | None) -> dict:
    """The options each save's ``ZarrWriter`` is given; a wrong one is refused here, by name."""
    if "path" in writer_options or "store" in writer_options:
        raise TypeError("CheckpointManager: the manager chooses each step's path; do not pass path= or store=")
    if "incremental_from" in writer_options:
        raise TypeError("CheckpointManager: the manager chooses each save's incremental_from (the newest complete "
                        "step); pass incremental=True instead")
    if incremental not in (True, False):
        raise TypeError(f"CheckpointManager: incremental={incremental!r}, expected True or False")
    if incremental:
        writer_options["incremental"] = True
    ZarrWriter(os.devnull, storage_options=storage_options, **writer_options)  # a wrong option fails here, named
    return writer_options


def _positive_or_none(name: str, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"CheckpointManager: {name}={value!r} must be a positive int or None")
    return int(value)


def _checked_step(step, root: str) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"{root}: step {step!r} must be an int >= 0")
    return int(step)


def _seen(stores: list[StepStore]) -> str:
    incomplete = [s.name for s in stores if not s.complete and s.other_format is None]
    return f" (incomplete, never loaded: {', '.join(incomplete)})" if incomplete else ""
