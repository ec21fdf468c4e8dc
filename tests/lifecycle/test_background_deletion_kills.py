"""A kill at any moment of a background deletion leaves every newer step loadable, and the next manager finishes the
deletion.

A two-rank job runs a ``CheckpointManager`` with retention; the save that drops the oldest step hands its deletion to
the manager's retention thread (lifecycle/background.py) and the job goes on saving the next step while it runs.
Rank 0's retention thread counts what the deletion does to the root (``DeletionKills``): locally the rename aside,
then each file and folder the removal unlinks, then the staging directory; on an object store the ``deleting``
record, the commit marker, the batch delete of the rest (which a kill can cut in two) and the record's removal. At a
chosen one of them, before it or once done, it SIGKILLs the whole job, every rank, itself last. The kill points are
counted in a clean run's deletion (locally; an object store's are the four above), so every phase is hit every
time, not by chance. Every kill point's outcome is printed (``pytest -s``).

After each kill a fresh manager on the root must list every step newer than the dropped one, load each of them
(``dcp.load``) equal to what was saved under it, list the dropped step only while its deletion had not begun (and
then load it whole too), have finished the deletion by the end of its start (no renamed-aside folder, no record,
nothing of the dropped step), and save and apply retention as usual after it.

Incremental trials matter most: a step saved with ``incremental=True`` hard-links the unchanged chunks of the step
before it, so the step being deleted and the newer steps share files; deleting the one must not damage the others.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import warnings

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import CheckpointManager
from dcp_zarr.format.manifest import ROOT_KEY
from dcp_zarr.lifecycle.deletion import finish_deletions, interrupted_deletions
from dcp_zarr.lifecycle.lease import LEASE_KEY
from dcp_zarr.lifecycle.records import RECORDS
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.lifecycle.step_forms import step_name
from tests.support.compare import assert_state_equal
from tests.support.faults import INCREMENTAL_WRITER_OPTIONS, incremental_state, sharded_incremental_state
from tests.support.states import blank_like

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

WORLD_SIZE = 2
TEMPLATE = incremental_state(0)
RETENTION_THREAD = "dcp-zarr-retention"  # background.py's thread_name_prefix


def seed_of(step: int) -> int:
    return 1000 + step


# --------------------------------------------------------------------------------------------------
# In the ranks: the job, and the kill hook on rank 0's retention thread
# --------------------------------------------------------------------------------------------------


class DeletionKills:
    """Counts every mutation rank 0's retention thread makes to the root, logs each once done (``events``), and at
    ``kill = {"event": n, "how": "before" | "after" | "torn"}`` SIGKILLs every rank of the job (their pids are in
    ``log_dir``), this one last: before the n-th mutation, once it is done, or (a batch delete) halfway through it.

    Local roots: ``os.rename``, ``os.unlink``/``os.remove`` and ``os.rmdir`` (shutil.rmtree's, by file). Object
    stores: the storage's ``write_json``, ``remove`` and ``remove_all``. Also logged, never kill points: ``begin N``
    and ``end N`` around each deletion."""

    def __init__(self, log_dir: str, world_size: int, kill: dict | None, storage_class: type | None):
        from dcp_zarr.lifecycle import deletion

        self.log_dir, self.world_size, self.kill = log_dir, world_size, kill
        self.fd = os.open(os.path.join(log_dir, "deletion.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.count = 0
        self.lock = threading.Lock()
        self.real: dict[str, object] = {}
        if storage_class is None:
            for name, kind in (("rename", "rename"), ("unlink", "unlink"), ("remove", "unlink"), ("rmdir", "rmdir")):
                self._wrap(os, name, kind)
        else:
            self._wrap(storage_class, "write_json", "write")
            self._wrap(storage_class, "remove", "remove")
            self._wrap(storage_class, "remove_all", "remove_all")
        real_delete = deletion.delete_step

        def delete_step(root, step, name=None):
            self._log(f"begin {step}")
            real_delete(root, step, name)
            self._log(f"end {step}")

        deletion.delete_step = delete_step

    def _log(self, line: str) -> None:
        if threading.current_thread().name.startswith(RETENTION_THREAD):
            os.write(self.fd, f"{line}\n".encode())

    def _wrap(self, owner, name: str, kind: str) -> None:
        real = self.real[name] = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if not threading.current_thread().name.startswith(RETENTION_THREAD):
                return real(*args, **kwargs)
            with self.lock:
                self.count += 1
                dies = self.kill is not None and self.kill["event"] == self.count
            what = f"{kind} {_named(args)}"
            if dies and self.kill["how"] == "before":
                self._kill_the_job()
            if dies and self.kill["how"] == "torn":
                self._remove_half(args[0])
                self._log(f"{what} (half)")
                self._kill_the_job()
            try:
                return real(*args, **kwargs)
            finally:  # whether it worked or not: the staging directory's rmdir fails while a save stages there
                self._log(what)
                if dies:
                    self._kill_the_job()

        setattr(owner, name, wrapper)

    def _remove_half(self, storage) -> None:
        """A batch delete cut by the kill: half of ``storage``'s keys gone, its commit marker among the survivors (a
        server deletes a batch in no promised order)."""
        keys = sorted(storage.first_keys(1 << 20), key=lambda key: key == ROOT_KEY)
        for key in keys[: len(keys) // 2]:
            self.real["remove"](storage, key)

    def _kill_the_job(self) -> None:
        for rank in range(self.world_size):
            pid, started = _rank_process(self.log_dir, rank)
            if pid != os.getpid() and _started(pid) == started:  # not a process that reused an exited rank's pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # that rank had finished its part
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached


def _started(pid: int) -> str | None:
    """When process ``pid`` started (/proc's clock ticks since boot), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _rank_process(log_dir: str, rank: int) -> tuple[int, str | None]:
    with open(os.path.join(log_dir, f"rank{rank}.pid")) as f:
        pid, started = f.read().split()
    return int(pid), started


def _named(args: tuple) -> str:
    """What a hooked call acts on, for the log: a path's last part, or a storage's key."""
    for arg in args:
        if isinstance(arg, (str, os.PathLike)):
            return os.path.basename(os.fspath(arg)) or os.fspath(arg)
    return "*"


def deleting_job(rank: int, world_size: int, report, root: str, options: dict, steps: list[int], log_dir: str,
                 kill: dict | None = None):
    """Rank program: a manager on ``root`` saves ``sharded_incremental_state(seed_of(step))`` for each of
    ``steps``, then closes; rank 0's retention thread runs ``DeletionKills``."""
    from dcp_zarr.storage import storage_class

    with open(os.path.join(log_dir, f"rank{rank}.pid"), "w") as f:
        f.write(f"{os.getpid()} {_started(os.getpid())}")
    if rank == 0:
        local = storage_class(root).commits_by_rename
        DeletionKills(log_dir, world_size, kill, None if local else storage_class(root))
    with CheckpointManager(root, **options) as manager:
        for step in steps:
            manager.save(step, sharded_incremental_state(seed_of(step), world_size))


def logged(log_dir: str) -> list[str]:
    try:
        with open(os.path.join(log_dir, "deletion.log")) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


# --------------------------------------------------------------------------------------------------
# In the test: a root to delete from, the kills, the next manager's checks
# --------------------------------------------------------------------------------------------------


class Scenario:
    """A root holding the complete steps ``kept`` (made once, copied per trial locally), and a job that saves
    ``steps`` into it with ``options``; the first save that leaves more than ``keep_last`` complete steps drops the
    oldest, whose deletion is the one killed, while the job saves the next step (``in_flight``)."""

    def __init__(self, options: dict, kept: list[int], steps: list[int]):
        self.options, self.kept, self.steps = options, kept, steps
        trigger = options["keep_last"] - len(kept)  # the index in steps of the first save that drops one
        assert 0 <= trigger < len(steps), f"{kept} then {steps} drop no step at keep_last={options['keep_last']}"
        complete = kept + steps[:trigger + 1]
        self.dropped = complete[0]
        self.newer = set(complete[1:])  # complete before the deletion began: the save that asked for it had finished
        self.in_flight = steps[trigger + 1] if trigger + 1 < len(steps) else None  # saved while the deletion runs


class Trials:
    """Launches of ``deleting_job`` under ``base``, each with a log directory of its own."""

    def __init__(self, zygote, base: str):
        self.zygote, self.base, self.launches = zygote, base, 0

    def run(self, root: str, options: dict, steps: list[int], kill: dict | None) -> tuple[dict, list[str]]:
        """Each rank's outcome (``Launch.wait``), and the retention thread's log."""
        self.launches += 1
        log_dir = os.path.join(self.base, "logs", str(self.launches))
        os.makedirs(log_dir)
        outcomes = self.zygote.launch(deleting_job, WORLD_SIZE, root, options, steps, log_dir, kill).wait(120)
        return outcomes, logged(log_dir)

    def make(self, root: str, options: dict, steps: list[int]) -> list[str]:
        """A run that must finish; the retention thread's log."""
        outcomes, events = self.run(root, options, steps, None)
        assert all(o[0] == "ok" for o in outcomes.values()), outcomes
        return events

    def kill(self, root: str, scenario: Scenario, kill: dict, label: str) -> list[str]:
        outcomes, events = self.run(root, scenario.options, scenario.steps, kill)
        assert outcomes[0][0] == "died", f"{label}: the kill point was never reached: {outcomes}"
        assert f"begin {scenario.dropped}" in events, f"{label}: killed outside the deletion of step " \
                                                       f"{scenario.dropped}: {events}"
        return events


def first_deletion(events: list[str], dropped: int) -> list[str]:
    """The mutations of the deletion of ``dropped``, in order, from a run's log."""
    start, end = events.index(f"begin {dropped}"), events.index(f"end {dropped}")
    assert start == 0, f"the deletion of step {dropped} was not the job's first: {events}"
    return events[start + 1:end]


def phase(events: list[str], dropped: int) -> str:
    """How far the deletion got before the kill, in words."""
    done = events[events.index(f"begin {dropped}") + 1:]
    if f"end {dropped}" in done:
        return "deletion finished"
    if not done:
        return "before its first step"
    return f"after {len(done)} steps, the last {done[-1]!r}"


def load_equal(manager: CheckpointManager, step: int, label: str) -> None:
    target = blank_like(TEMPLATE)
    try:
        assert manager.load(target, step=step) == step
        assert_state_equal(target, incremental_state(seed_of(step)))
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise AssertionError(f"{label}: step {step} does not load as saved: {type(exc).__name__}: {exc}") from exc


def check_next_manager(root: str, scenario: Scenario, events: list[str], label: str, storage_options=None) -> str:
    """A fresh manager after the kill: the newer steps listed and loading as saved, the dropped one only if its
    deletion had not begun (and whole), the deletion finished by its start; then it saves and keeps as before.
    Returns whether the dropped step was still listed."""
    dropped = scenario.dropped
    begun = len(events) > events.index(f"begin {dropped}") + 1  # a first mutation of the deletion was made
    options = dict(scenario.options, storage_options=storage_options)
    with CheckpointManager(root, **options) as manager:
        listed = manager.steps()
        in_flight = scenario.in_flight  # its save was running: complete or not, either is fine
        missing = scenario.newer - set(listed)
        assert not missing, f"{label}: newer steps {sorted(missing)} are not listed (listed: {listed})"
        assert set(listed) <= scenario.newer | {dropped, in_flight}, f"{label}: listed {listed}"
        if begun:
            assert dropped not in listed, f"{label}: step {dropped} is listed though its deletion had begun"
        for step in listed:
            load_equal(manager, step, label)
        # the start of this manager finished the deletion: nothing of it is left
        left = manager.root.leftovers() + [f"{kind}-{s}" for kind, s in manager.root.records()]
        assert not left, f"{label}: left once the next manager started: {left}"
        if dropped not in listed:
            assert step_name(dropped) not in manager.root.names(), \
                f"{label}: {step_name(dropped)} is still there after the next manager started"
        # and it goes on: a save, retention, the deletions waited for
        after = max(listed) + 1
        manager.save(after, incremental_state(seed_of(after)))
        manager.wait()
        keep = manager.keep_last
        assert keep is not None
        expected = sorted(set(listed) | {after})[-keep:]
        assert manager.steps() == expected, f"{label}: after the next save: {manager.steps()}, expected {expected}"
        for step in expected:
            load_equal(manager, step, f"{label}, after the next save")
        names = set(manager.root.names())
        expected_names = {step_name(s) for s in expected} | {RECORDS}
        assert names == expected_names, f"{label}: the root holds {sorted(names - expected_names)} besides its steps"
        assert manager.root.names(RECORDS) == [os.path.basename(LEASE_KEY)], manager.root.names(RECORDS)
    return "listed" if dropped in listed else "gone"


def copy_root(template: str, root: str) -> None:
    """A copy of ``template`` whose hard links stay links (``cp -a``): the incremental steps share files."""
    subprocess.run(["cp", "-a", template, root], check=True)


def local_kill_points(deletion: list[str], stride: int | None) -> list[tuple[str, dict]]:
    """Kill points over a local deletion's mutations (the rename aside, each file and folder removed, the staging
    directory): with a ``stride``, before every ``stride``-th of them from the rename on, after the rename, and after
    the last; else named ones: the rename, the removal's first file, a quarter, half, three quarters, its last file,
    the emptied folder, the staging directory, after all."""
    n = len(deletion)
    files = [i for i, e in enumerate(deletion, 1) if e.startswith("unlink ")]
    assert len(files) >= 10, f"too few files to land kills inside the removal: {deletion}"
    finished = ("the deletion finished", {"event": n, "how": "after"})
    if stride is not None:
        return [("before the rename", {"event": 1, "how": "before"}),
                ("after the rename", {"event": 1, "how": "after"})] + \
            [(f"before mutation {i}, {deletion[i - 1]!r}", {"event": i, "how": "before"})
             for i in sorted(set(range(1 + stride, n + 1, stride)) | {n})] + [finished]
    aside = n - 1  # the renamed folder's own rmdir, once emptied: the last before the staging directory's
    return [
        ("before the rename", {"event": 1, "how": "before"}),
        ("after the rename", {"event": 1, "how": "after"}),
        ("after the first file removed", {"event": files[0], "how": "after"}),
        ("a quarter of the files removed", {"event": files[len(files) // 4], "how": "after"}),
        ("half of the files removed", {"event": files[len(files) // 2], "how": "after"}),
        ("three quarters removed", {"event": files[3 * len(files) // 4], "how": "after"}),
        ("every file removed, the folders not", {"event": files[-1], "how": "after"}),
        ("before the emptied aside folder's removal", {"event": aside, "how": "before"}),
        ("before the staging directory's removal", {"event": n, "how": "before"}),
        finished,
    ]


def run_local_sweep(zygote, tmp_path, scenario: Scenario, stride: int | None) -> dict[str, str]:
    trials = Trials(zygote, str(tmp_path))
    template = str(tmp_path / "template")
    trials.make(template, scenario.options, scenario.kept)
    assert CheckpointRoot(template).names() and [s.step for s in CheckpointRoot(template).step_stores()] \
        == scenario.kept, os.listdir(template)
    probe = str(tmp_path / "probe")
    copy_root(template, probe)
    deletion = first_deletion(trials.make(probe, scenario.options, scenario.steps), scenario.dropped)
    outcomes = {}
    for n, (name, kill) in enumerate(local_kill_points(deletion, stride)):
        root = str(tmp_path / f"trial{n}")
        copy_root(template, root)
        label = f"killed {name} (mutation {kill['event']} of {len(deletion)}, {kill['how']})"
        events = trials.kill(root, scenario, kill, label)
        outcomes[name] = f"{phase(events, scenario.dropped)}: dropped step " + \
            check_next_manager(root, scenario, events, label)
        shutil.rmtree(root)
    # where the kills were meant to land (checked last, so that a deletion that went otherwise meets the trials first)
    assert deletion[0].startswith("rename ") and ".deleting-" in deletion[-2] and \
        deletion[-1] == "rmdir .dcp-zarr-staging", deletion
    return outcomes


# --------------------------------------------------------------------------------------------------
# The trials
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_a_kill_anywhere_in_deleting_an_incremental_step_leaves_the_steps_linking_to_it_whole(zygote, tmp_path):
    """keep_last=1, incremental: step 1's chunks are hard-linked by step 2; saving step 2 drops step 1, whose
    deletion runs while step 3 is saved (linking step 2's chunks)."""
    scenario = Scenario(dict(keep_last=1, incremental=True, **INCREMENTAL_WRITER_OPTIONS), kept=[1], steps=[2, 3])
    outcomes = run_local_sweep(zygote, tmp_path, scenario, stride=None)
    print("\nkilled while deleting an incremental step:\n  " + "\n  ".join(f"{k}: {v}" for k, v in outcomes.items()))
    assert outcomes["before the rename"].endswith("listed")
    assert all(v.endswith("gone") for k, v in outcomes.items() if k != "before the rename")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_kill_anywhere_in_deleting_a_full_step_leaves_the_newer_steps_whole(zygote, tmp_path):
    """keep_last=2, full saves: saving step 2 drops step 0 (steps 1 and 2 stay), deleted while step 3 is saved; a
    full save is a few files (one shard an array), so the job is killed before every second one of the deletion's
    mutations, from the rename to the staging directory's removal."""
    scenario = Scenario(dict(keep_last=2, **INCREMENTAL_WRITER_OPTIONS), kept=[0, 1], steps=[2, 3])
    outcomes = run_local_sweep(zygote, tmp_path, scenario, stride=2)
    print("\nkilled while deleting a full step:\n  " + "\n  ".join(f"{k}: {v}" for k, v in outcomes.items()))
    assert all(v.endswith("gone") for k, v in outcomes.items() if k != "before the rename")


S3_KILL_POINTS = [  # the deletion's mutations on an object store: the record, the marker, the rest, the record
    ("after the deleting record", {"event": 1, "how": "after"}),
    ("halfway through the batch delete", {"event": 3, "how": "torn"}),
    ("after the batch delete, the record left", {"event": 3, "how": "after"}),
]
S3_DELETION = ["write", "remove", "remove_all", "remove"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
def test_a_kill_in_deleting_a_step_on_an_object_store_is_finished_by_the_next_manager(zygote, s3, aws_environment,
                                                                                       tmp_path):
    """keep_last=1, incremental (server-side copies): the job saves steps 0, 1 and 2; saving step 1 drops step 0,
    deleted while step 2 is saved. Killed once the deleting record is written (the store still whole), with the
    batch delete of the rest half done (the commit marker went first), and with only the record left."""
    # larger chunks than locally (fewer objects: a loopback S3 server takes tens of milliseconds an object), still
    # some dozens for the batch delete to be cut in two
    options = dict(keep_last=1, incremental=True, storage_options=s3.storage_options(),
                   **dict(INCREMENTAL_WRITER_OPTIONS, inner_chunk_bytes=128 << 10))
    scenario = Scenario(options, kept=[], steps=[0, 1, 2])
    trials = Trials(zygote, str(tmp_path))
    outcomes = {}
    for n, (name, kill) in enumerate(S3_KILL_POINTS):
        root = f"s3://{s3.bucket}/trial{n}"
        label = f"S3, killed {name}"
        events = trials.kill(root, scenario, kill, label)
        outcomes[name] = f"{phase(events, 0)}: dropped step " + \
            check_next_manager(root, scenario, events, label, s3.storage_options())
        done = [e.split()[0] for e in events[events.index("begin 0") + 1:]]
        assert done == S3_DELETION[:len(done)], f"{label}: the deletion went {events}, not {S3_DELETION}"
    print("\nkilled while deleting on S3:\n  " + "\n  ".join(f"{k}: {v}" for k, v in outcomes.items()))
    assert all(v.endswith("gone") for v in outcomes.values())


# --------------------------------------------------------------------------------------------------
# What the trials found, one case each
# --------------------------------------------------------------------------------------------------


def small_state(step: int) -> dict:
    return {"w": torch.full((64, 8), float(step)), "step": torch.tensor(step)}


def test_a_deletion_finds_the_staging_directory_a_save_just_removed_and_makes_it_again(tmp_path, monkeypatch):
    """Retention deletes beside the next save; that save's commit removes the shared staging directory once it is
    empty, which it can be between the deletion making it and renaming the step into it (here, every time)."""
    root = tmp_path / "run"
    with CheckpointManager(root) as manager:
        for step in range(2):
            manager.save(step, small_state(step))
    real_rename, raced = os.rename, []

    def rename(source, target, *args, **kwargs):
        if ".deleting-" in os.fspath(target) and not raced:
            raced.append(target)
            os.rmdir(os.path.dirname(target))  # a save's commit, between the deletion's makedirs and its rename
        return real_rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    CheckpointRoot(root).delete_step(0)
    assert raced and sorted(os.listdir(root)) == [RECORDS, step_name(1)]


def test_an_interrupted_object_store_deletion_is_finished_under_the_name_it_was_deleting(monkeypatch):
    """On an object store (no rename) a deletion is recorded first; one of a store named in another form
    (torchtitan's ``step-5``, as ``dcp-zarr prune`` deletes it) is finished under that name, not as
    ``step-00000005.zarr``."""
    import torch.distributed.checkpoint as dcp

    from dcp_zarr import ZarrWriter
    from dcp_zarr.storage.zarr_store import ZarrStoreStorage

    url = "memory://background-deletion-kills/titan"
    dcp.save(small_state(5), storage_writer=ZarrWriter(f"{url}/step-5"))
    assert [(s.name, s.complete) for s in CheckpointRoot(url).step_stores()] == [("step-5", True)]

    class Killed(BaseException):
        pass

    def killed(self):  # the process died once the commit marker was gone, before the rest
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(ZarrStoreStorage, "remove_all", killed)
        with pytest.raises(Killed):
            CheckpointRoot(url).delete_step(5, "step-5")
    root = CheckpointRoot(url)
    assert root.records() == [("deleting", 5)] and [s.complete for s in root.step_stores()] == [False]
    assert root.clean_leftovers() == ["step-5 (a deletion that was interrupted)"]
    assert root.step_stores() == [] and root.records() == []
    assert "step-5" not in root.names()
    # finish_deletions (the torchtitan adapter's) finishes it too
    dcp.save(small_state(5), storage_writer=ZarrWriter(f"{url}/step-5"))
    with monkeypatch.context() as patched:
        patched.setattr(ZarrStoreStorage, "remove_all", killed)
        with pytest.raises(Killed):
            CheckpointRoot(url).delete_step(5, "step-5")
    assert finish_deletions(root, interrupted_deletions(root)) == ["step-5 (a deletion that was interrupted)"]
    assert root.step_stores() == [] and root.records() == []


def test_finishing_deletions_leaves_what_a_save_under_way_staged(tmp_path):
    """``finish_deletions`` (the torchtitan adapter's, which holds no lease) removes the folders a killed deletion
    renamed aside, never a save's staging directory: that save may be running."""
    with CheckpointManager(tmp_path) as manager:
        for step in range(2):
            manager.save(step, small_state(step))
    staging = tmp_path / ".dcp-zarr-staging"
    staging.mkdir()
    os.rename(tmp_path / step_name(0), staging / f"{step_name(0)}.deleting-0123abcd")  # as a killed deletion left it
    shutil.copytree(tmp_path / step_name(1), staging / f"{step_name(2)}.partial-4567ef")  # a save under way
    root = CheckpointRoot(tmp_path)
    finished = finish_deletions(root, interrupted_deletions(root))
    assert finished == [f".dcp-zarr-staging/{step_name(0)}.deleting-0123abcd"]
    assert os.listdir(staging) == [f"{step_name(2)}.partial-4567ef"]
    assert [s.step for s in root.step_stores()] == [1]
