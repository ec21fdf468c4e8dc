"""CheckpointManager: steps, retention, the root's lease, cleanup of killed saves, async saves and resume at another
world size, on local paths and the loopback S3 server."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from dcp_zarr import CheckpointManager, CheckpointRootBusyError, StepNotFoundError, ZarrCheckpointError, ZarrSavePlanner
from dcp_zarr.lifecycle.lease import LEASE_KEY
from dcp_zarr.lifecycle.records import RECORDS
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.lifecycle.step_forms import StepForm, step_name
from dcp_zarr.store_io.commit import STAGING_DIR, STAGING_MARK
from tests.support.compare import assert_state_equal
from tests.support.faults import crash_state, managed_save_program
from tests.support.ranks import run_ranks
from tests.support.states import load_full

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

WORLD_SIZE = 2
TRIAL_SEED = 20261201
TEMPLATE = crash_state(0)
TRIAL_OPTIONS = {"keep_last": 2, "thread_count": 2, "inner_chunk_bytes": 2048}


def state(step: int) -> dict:
    return {"w": torch.full((4, 3), float(step)), "meta": {"step": step, "name": f"run-{step}"}}


def saved_step(manager: CheckpointManager, step: int) -> int:
    target = {"w": torch.zeros(4, 3), "meta": {"step": -1, "name": ""}}
    assert manager.load(target, step=step) == step
    assert torch.equal(target["w"], torch.full((4, 3), float(step))) and target["meta"]["step"] == step
    return target["meta"]["step"]


# -- steps and retention -------------------------------------------------------------------------------------------


def test_keep_last_and_keep_every_delete_only_what_they_no_longer_keep(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "notes.txt").write_text("mine")  # foreign files: never touched
    (root / "other.zarr").mkdir()
    with CheckpointManager(root, keep_last=2, keep_every=4) as manager:
        for step in range(11):
            manager.save(step, state(step))
        assert manager.steps() == [0, 4, 8, 9, 10]
        assert manager.latest_step() == 10
        assert [saved_step(manager, s) for s in manager.steps()] == [0, 4, 8, 9, 10]
    expected = [RECORDS, "notes.txt", "other.zarr"] + [step_name(s) for s in (0, 4, 8, 9, 10)]
    assert sorted(os.listdir(root)) == sorted(expected)
    assert os.listdir(root / RECORDS) == [], "the lease is given back at close, and no record is left"


def test_a_manager_reads_again_only_the_steps_it_did_not_commit(tmp_path, monkeypatch):
    """Listing a step store reads its root zarr.json (some ms for a store of a few hundred arrays, a request on an
    object store); a manager holding the root's lease takes the steps it committed as complete, read or not."""
    with CheckpointManager(tmp_path, keep_last=2) as manager:
        manager.save(0, state(0))
    read, real_state = [], StepForm.state
    monkeypatch.setattr(StepForm, "state", lambda form, root, name: read.append(name) or real_state(form, root, name))
    with CheckpointManager(tmp_path) as manager:  # no retention: a step handed to deletion may be read again
        for step in range(1, 5):
            manager.save(step, state(step))  # each save lists the root for retention
        assert manager.steps() == [0, 1, 2, 3, 4]
        assert [saved_step(manager, s) for s in manager.steps()] == [0, 1, 2, 3, 4]
    assert read and set(read) == {step_name(0)}, "step 0, another manager's, is read; this one's never"


def test_retention_deletes_in_the_background_and_save_returns_before_it_is_done(tmp_path, monkeypatch):
    root = tmp_path / "run"
    release, order, threads = threading.Event(), [], set()
    real = CheckpointRoot.delete_step

    def slow_delete(self, step, name=None):
        threads.add(threading.current_thread().name)
        assert release.wait(30), "the test never released the deletion"
        order.append(step)
        real(self, step, name)

    monkeypatch.setattr(CheckpointRoot, "delete_step", slow_delete)
    with CheckpointManager(root, keep_last=1) as manager:
        for step in range(3):
            manager.save(step, state(step))  # returns while steps 0, then 1, wait to be deleted
        assert manager.steps() == [2], "a step being deleted is no longer listed"
        assert os.path.isdir(root / step_name(0)), "the deletion has not run: the test holds it"
        release.set()
        manager.wait()
        assert sorted(os.listdir(root)) == sorted([RECORDS, step_name(2)])
        assert threads and threading.current_thread().name not in threads, "deleted off the caller's thread"
        assert order == [0, 1], "one deletion at a time, in order"
        assert saved_step(manager, 2) == 2


def _save_while_deletions_fail(rank, world_size, root):
    def failing_delete(self, step, name=None):
        raise PermissionError(f"cannot remove {name} (injected)")

    CheckpointRoot.delete_step = failing_delete  # this rank process's own class: gone with the process
    manager = CheckpointManager(root, keep_last=1)
    manager.save(0, state(0))
    manager.save(1, state(1))  # asks for step 0's deletion (rank 0 deletes), which fails on the retention thread
    manager._deletions.join()
    raised = None
    try:
        manager.save(2, state(2))  # every rank takes part: rank 0 raises only once the save is done
    except ZarrCheckpointError as exc:
        raised = str(exc)
    try:
        manager.close()  # save 2's deletions failed too
    except ZarrCheckpointError as exc:
        raised = f"{raised} | {exc}"
    return raised


@pytest.mark.distributed
def test_a_failed_background_deletion_is_raised_naming_the_step_after_the_next_save(tmp_path):
    root = str(tmp_path / "run")
    raised = run_ranks(_save_while_deletions_fail, 2, root, timeout=90)
    assert raised[1] is None, "only the rank that deletes raises"
    assert re.search(r"retention could not delete step 0 \(step-0+\.zarr\).*injected", raised[0]), raised[0]
    # save 2's retention asked again for step 0 (still there), then for step 1: both failed, raised by then or by close
    assert re.search(r"\bsteps? 1\b", raised[0]), raised[0]
    with CheckpointManager(root) as again:
        assert again.steps() == [0, 1, 2], "nothing was lost, and the save that raised was made"


def _save_after_losing_the_lease(rank, world_size, root):
    manager = CheckpointManager(root)
    manager.save(0, state(0))
    if rank == 0:  # what the lease's heartbeat finds when another manager took the root
        manager._lease.lost = "manager other (host elsewhere) holds it now (injected)"
    try:
        manager.save(1, state(1))
    except CheckpointRootBusyError as exc:
        return str(exc)
    return None


@pytest.mark.distributed
def test_a_lost_lease_stops_the_save_on_every_rank_before_its_collectives(tmp_path):
    """Only rank 0 holds the lease; the other ranks hear that it was lost before the save's collectives, rather than
    wait in them for a rank that will never come."""
    root = str(tmp_path / "run")
    raised = run_ranks(_save_after_losing_the_lease, 2, root, timeout=60)
    assert raised[0] and "lost its lease" in raised[0] and "other" in raised[0], raised
    assert raised[1] and "rank 0's CheckpointManager could not begin step 1" in raised[1], raised
    assert "lost its lease" in raised[1], raised
    assert not os.path.exists(os.path.join(root, step_name(1))), "nothing of step 1 was written"


def test_without_keep_last_every_checkpoint_stays_and_steps_sort_numerically(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        for step in (3, 100_000_000, 20):  # past the padded width too
            manager.save(step, state(step))
        assert manager.steps() == [3, 20, 100_000_000]
        assert manager.path(20) == str(tmp_path / "step-00000020.zarr")


def test_a_store_named_without_the_padding_is_a_step_too_and_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    from dcp_zarr import ZarrWriter

    dcp.save(state(3), planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(tmp_path / "step-3.zarr"))  # written by hand, not by a manager
    with CheckpointManager(tmp_path) as manager:
        assert manager.steps() == [3] and saved_step(manager, 3) == 3
        target = {"w": torch.zeros(4, 3), "meta": {"step": -1, "name": ""}}
        assert manager.load(target) == 3 and target["meta"]["step"] == 3


def test_loading_the_latest_resumes_and_returns_its_step(tmp_path):
    with CheckpointManager(tmp_path, keep_last=1) as manager:
        manager.save(1, state(1))
        manager.save(2, state(2))
        target = {"w": torch.zeros(4, 3), "meta": {"step": 0, "name": ""}}
        assert manager.load(target) == 2 and target["meta"] == {"step": 2, "name": "run-2"}


def test_an_async_save_is_waited_for_by_the_next_save_and_retention_follows_it(tmp_path):
    with CheckpointManager(tmp_path, keep_last=1) as manager:
        first = manager.save(1, state(1), async_save=True)
        second = manager.save(2, state(2), async_save=True)  # waits for the first
        assert first.done()
        manager.wait()
        assert second.done() and manager.steps() == [2]


def test_an_async_save_error_is_raised_by_wait(tmp_path):
    with CheckpointManager(tmp_path, overwrite=False) as manager:
        manager.save(1, state(1))
        manager.save(1, state(1), async_save=True)  # step 1 exists and overwrite is off
        with pytest.raises(BaseException, match="Checkpoint already exists"):
            manager.wait()
        assert manager.steps() == [1] and saved_step(manager, 1) == 1


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_saved_again_after_resuming_from_an_earlier_one_replaces_it(tmp_path, async_save):
    """A job that resumes from step 1 after step 2 was saved saves step 2 again: by default the new one replaces it
    (once complete), as FileSystemWriter would; frameworks resuming from an earlier step do exactly this."""
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state(1))
        manager.save(2, state(2))
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state(5), async_save=async_save)
        manager.wait()
        target = {"w": torch.zeros(4, 3), "meta": {"step": -1, "name": ""}}
        assert manager.steps() == [1, 2] and manager.load(target) == 2
        assert torch.equal(target["w"], state(5)["w"]) and target["meta"] == state(5)["meta"]
    assert sorted(os.listdir(tmp_path)) == [".dcp-zarr", step_name(1), step_name(2)]


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", None])
def test_a_step_that_is_not_an_int_of_zero_or_more_is_refused_naming_the_root(tmp_path, step):
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(ValueError, match=f"{tmp_path}.*step {step!r} must be an int >= 0"):
            manager.save(step, state(0))


def test_loading_a_missing_step_names_the_root_and_the_steps_there_are(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(StepNotFoundError, match=f"no complete checkpoint under {tmp_path}"):
            manager.load(state(0))
        manager.save(2, state(2))
        manager.save(5, state(5))
        with pytest.raises(StepNotFoundError, match=r"no complete checkpoint of step 3; complete steps: 2, 5"):
            manager.load(state(0), step=3)


@pytest.mark.parametrize("options, match", [
    ({"keep_last": 0}, "keep_last=0 must be a positive int"),
    ({"keep_every": -2}, "keep_every=-2 must be a positive int"),
    ({"thread_cnt": 4}, "thread_cnt"),
    ({"path": "x"}, "do not pass path= or store="),
])
def test_bad_manager_options_are_refused_by_name(tmp_path, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        CheckpointManager(tmp_path, **options)


def test_a_root_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        CheckpointManager(tmp_path / "file")


# -- the lease -----------------------------------------------------------------------------------------------------


def test_a_second_manager_on_a_live_root_is_refused_and_takes_over_once_the_first_closes(tmp_path):
    first = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointRootBusyError, match=f"{tmp_path} is held by manager .*pid {os.getpid()}"):
        CheckpointManager(tmp_path)
    first.close()
    CheckpointManager(tmp_path).close()


_HOLD_AND_WAIT = """
import sys, time
from dcp_zarr import CheckpointManager
manager = CheckpointManager(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_the_lease_of_a_killed_process_on_this_host_is_stale_at_once(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_AND_WAIT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointRootBusyError, match=f"pid {holder.pid}"):
            CheckpointManager(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    CheckpointManager(tmp_path).close()


def _write_lease(root, host: str, age_s: float) -> None:
    (root / RECORDS).mkdir(exist_ok=True)
    record = {"holder": "elsewhere", "host": host, "pid": 1, "heartbeat": time.time() - age_s, "timeout_s": 60}
    (root / LEASE_KEY).write_text(json.dumps(record))


def test_a_lease_from_another_host_holds_until_its_heartbeat_is_older_than_its_timeout(tmp_path):
    _write_lease(tmp_path, "node-17", age_s=5)
    with pytest.raises(CheckpointRootBusyError, match="host node-17.*5.0 s ago"):
        CheckpointManager(tmp_path)
    _write_lease(tmp_path, "node-17", age_s=61)
    CheckpointManager(tmp_path).close()
    assert socket.gethostname() != "node-17"


def test_the_holder_refreshes_its_lease(tmp_path):
    with CheckpointManager(tmp_path, lease_timeout_s=0.4):
        first = json.loads((tmp_path / LEASE_KEY).read_text())["heartbeat"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LEASE_KEY).read_text())["heartbeat"] > first
        with pytest.raises(CheckpointRootBusyError):
            CheckpointManager(tmp_path, lease_timeout_s=0.4)  # refreshed: still live


# -- cleanup -------------------------------------------------------------------------------------------------------


def test_cleanup_removes_the_leftovers_of_saves_that_are_gone_and_nothing_else(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state(1))
    staging = tmp_path / STAGING_DIR / f"{step_name(2)}{STAGING_MARK}abc"  # a killed save of step 2
    (staging / "w").mkdir(parents=True)
    (staging / "w" / "c.0.0").write_bytes(b"\0" * 64)
    deleting = tmp_path / STAGING_DIR / f"{step_name(0)}.deleting-0f"  # a deletion killed halfway
    deleting.mkdir()
    # what versions before 0.2 left beside the stores
    legacy = [tmp_path / f".{step_name(3)}.dcp-zarr-partial-abc", tmp_path / f".{step_name(4)}.dcp-zarr-deleting-1"]
    for path in legacy:
        path.mkdir()
    foreign = [tmp_path / ".hidden-notes", tmp_path / "step-7.zarr.bak", tmp_path / ".other.zarr.dcp-zarr-partial-1",
               tmp_path / STAGING_DIR / f"other.zarr{STAGING_MARK}1"]
    for path in foreign:
        path.write_text("not ours")

    with CheckpointManager(tmp_path) as manager:
        assert not staging.exists() and not deleting.exists() and not any(path.exists() for path in legacy)
        assert all(path.exists() for path in foreign)
        assert manager.steps() == [1]


# -- killed saves: SIGKILL of one rank or all, at random moments ---------------------------------------------------


def _own_names(root: str) -> list[str]:
    """What the root holds besides the complete checkpoints and the foreign files the trials put there."""
    return sorted(n for n in os.listdir(root) if n not in ("notes.txt", "step-99999999.zarr")
                  and not (n.startswith("step-") and n.endswith(".zarr")))


def _check_after_kill(root: str, previous: int | None, step: int, label: str, storage_options=None,
                      cleaned: list | None = None) -> int | None:
    """The next manager's view after a killed trial: the previous or the new step is the latest (never an
    incomplete one), every complete step loads bit-exact as what was saved under it, and nothing of the dead save
    is left once that manager has cleaned up (what there was to clean is appended to ``cleaned``)."""
    before = CheckpointRoot(root, storage_options)
    found = before.leftovers() + [f"{kind} record" for kind, _ in before.records()]
    found += [s.name for s in before.step_stores() if not s.complete and s.step != 99999999]
    if cleaned is not None and found:
        cleaned.append(found)
    manager = CheckpointManager(root, storage_options=storage_options)
    try:
        latest = manager.latest_step()
        assert latest in {previous, step}, f"{label}: latest step {latest}, expected {previous} or {step}"
        if previous is not None:
            assert manager.steps(), f"{label}: no complete checkpoint is left"
        for kept in manager.steps():
            loaded = load_full(manager.path(kept), TEMPLATE, storage_options=storage_options)
            assert_state_equal(loaded, crash_state(1000 + kept))
        assert set(manager.steps()) <= {s for s in range(step + 1)}
        leftovers = manager.root.leftovers() + [f"{kind}-{s}" for kind, s in manager.root.records()]
        assert not leftovers, f"{label}: left behind after cleanup: {leftovers}"
        incomplete = [s.name for s in manager.root.step_stores() if not s.complete and s.step != 99999999]
        assert not incomplete, f"{label}: incomplete stores left: {incomplete}"
    finally:
        manager.close()
    return latest


def _run_kill_trials(zygote, root: str, trials: int, rng: random.Random, storage_options=None) -> dict:
    options = dict(TRIAL_OPTIONS, storage_options=storage_options)
    launch = zygote.launch(managed_save_program, WORLD_SIZE, root, 0, 1000, options)
    assert launch.wait_reported("saving", 60, ranks=[0])
    started = time.monotonic()
    assert all(o[0] == "ok" for o in launch.wait(120).values())
    clean = time.monotonic() - started  # from "saving" to the end: the span the kills below are spread over
    previous = _check_after_kill(root, None, 0, "clean save", storage_options)
    outcomes = {"previous": 0, "new": 0}
    cleaned: list = []
    for trial in range(1, trials + 1):
        ranks = None if rng.random() < 0.5 else [rng.randrange(WORLD_SIZE)]
        launch = zygote.launch(managed_save_program, WORLD_SIZE, root, trial, 1000 + trial, options)
        assert launch.wait_reported("saving", 60, ranks=[0]), f"trial {trial}: rank 0 never started saving"
        time.sleep(rng.uniform(0, clean))
        launch.kill(ranks)
        launch.wait(60)
        label = f"trial {trial}: {'all ranks' if ranks is None else f'rank {ranks[0]}'} killed"
        latest = _check_after_kill(root, previous, trial, label, storage_options, cleaned)
        outcomes["new" if latest == trial else "previous"] += 1
        previous = latest if latest == trial else previous
    outcomes["leftovers cleaned"] = len(cleaned)
    assert cleaned, "no trial left anything to clean: the cleanup was never exercised"
    return outcomes


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_at_random_moments_of_a_managed_save_never_leaves_an_incomplete_latest(zygote, tmp_path):
    root = str(tmp_path / "run")
    os.makedirs(os.path.join(root, "step-99999999.zarr"))  # foreign, though named like ours: never removed
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("not ours")
    outcomes = _run_kill_trials(zygote, root, 30, random.Random(TRIAL_SEED))
    print(f"\nmanaged save killed at random moments, local: {outcomes}")
    assert outcomes["new"] > 0 and outcomes["previous"] > 0, "the trials did not straddle the commit"
    assert os.path.isdir(os.path.join(root, "step-99999999.zarr"))
    assert open(os.path.join(root, "notes.txt")).read() == "not ours"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
def test_sigkill_of_a_managed_save_on_an_object_store_cleans_up_after_itself(zygote, s3, aws_environment):
    outcomes = _run_kill_trials(zygote, f"s3://{s3.bucket}/job", 12, random.Random(TRIAL_SEED + 1),
                                s3.storage_options())
    print(f"\nmanaged save killed at random moments, S3: {outcomes}")
    assert outcomes["new"] + outcomes["previous"] == 12 and outcomes["previous"] > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_save_is_refused_as_a_step_and_the_previous_one_loads(zygote, tmp_path):
    """A kill that surely lands mid-save: rank 1 dies at its first write of step 1."""
    root = str(tmp_path / "run")
    launch = zygote.launch(managed_save_program, WORLD_SIZE, root, 0, 1000, TRIAL_OPTIONS)
    assert all(o[0] == "ok" for o in launch.wait(120).values())
    kill = {"rank": 1, "event": 1, "kind": "write", "torn": False}
    outcome = zygote.launch(managed_save_program, WORLD_SIZE, root, 1, 1001, TRIAL_OPTIONS, kill).wait(60)
    assert outcome[1][0] == "died" and outcome[0][0] != "ok", outcome
    assert _check_after_kill(root, 0, 1, "rank 1 killed at the start of its save") == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_during_retention_never_leaves_zero_complete_checkpoints(zygote, tmp_path):
    """keep_last=1: the save of step 2 ends by deleting step 1. Rank 0 is killed at renames and unlinks spread over
    its whole save (the commit, then the deletion: the rename aside and the files under it)."""
    template = str(tmp_path / "template")
    options = dict(TRIAL_OPTIONS, keep_last=1)
    for step in (0, 1):
        assert all(o[0] == "ok" for o in zygote.launch(managed_save_program, WORLD_SIZE, template, step, 1000 + step,
                                                       options).wait(120).values())
    probe = str(tmp_path / "probe")
    shutil.copytree(template, probe)
    outcome = zygote.launch(managed_save_program, WORLD_SIZE, probe, 2, 1002, options).wait(120)
    sequence = outcome[0][1]
    points = [i for i, kind in enumerate(sequence, 1) if kind in ("rename", "unlink")]
    commit = next(i for i in points if sequence[i - 1] == "rename")  # the first rename: staging onto the target
    chosen = sorted({commit, commit + 1, *points[-3:], *points[len(points) // 2:: max(1, len(points) // 8)]})
    outcomes = {"previous": 0, "new": 0}
    for n, event in enumerate(chosen):
        root = str(tmp_path / f"trial{n}")
        shutil.copytree(template, root)
        kill = {"rank": 0, "event": event, "kind": sequence[event - 1], "torn": False}
        result = zygote.launch(managed_save_program, WORLD_SIZE, root, 2, 1002, options, kill).wait(60)
        assert result[0][0] == "died", f"event {event}: the kill point was never reached: {result}"
        latest = _check_after_kill(root, 1, 2, f"rank 0 killed at event {event} ({kill['kind']})")
        outcomes["new" if latest == 2 else "previous"] += 1
    print(f"\nkilled during commit and retention: {len(chosen)} trials, {outcomes}")
    assert outcomes["new"] > 0 and outcomes["previous"] > 0


# -- a training job: save every step on 2 ranks, resume on 3 -------------------------------------------------------


class _Loader:
    """A dataloader position as a Stateful (torchtitan keeps its dataloader state this way)."""

    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class _Rng:
    """torch's CPU RNG as a Stateful."""

    def state_dict(self):
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state):
        torch.set_rng_state(state["cpu"])


class _TrainState:
    """Model + optimizer through get_state_dict/set_state_dict, as torchtitan's ModelWrapper/OptimizersContainer."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))


def _app_state(world_size: int, seed: int):
    from tests.support.models import build

    model, optim = build("fsdp2", world_size, seed)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    loader = _Loader()
    return model, optim, scheduler, loader, {"train": _TrainState(model, optim), "lr_scheduler": scheduler,
                                             "dataloader": loader, "rng": _Rng()}


def _train_and_save_every_step(rank, world_size, root):
    from tests.support.models import full_state, train_steps

    model, optim, scheduler, loader, app = _app_state(world_size, seed=0)
    manager = CheckpointManager(root, keep_last=2)
    for step in range(1, 4):
        train_steps(model, optim, 1, first_batch=step)
        scheduler.step()
        loader.position += 8
        manager.save(step, app, async_save=True)
    manager.wait()
    manager.close()
    return full_state(model, optim), scheduler.state_dict(), loader.position, torch.get_rng_state()


def _resume(rank, world_size, root):
    from tests.support.models import full_state, prime_optimizer

    model, optim, scheduler, loader, app = _app_state(world_size, seed=1)
    prime_optimizer(model, optim)
    manager = CheckpointManager(root)
    step = manager.load(app)
    steps = manager.steps()
    manager.close()
    return step, steps, full_state(model, optim), scheduler.state_dict(), loader.position, torch.get_rng_state()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_job_saving_asynchronously_every_step_on_2_ranks_resumes_on_3(tmp_path):
    root = str(tmp_path / "job")
    saved = run_ranks(_train_and_save_every_step, 2, root)[0]
    resumed = run_ranks(_resume, 3, root)[0]

    step, steps, full, scheduler, position, rng = resumed
    assert step == 3 and steps == [2, 3]
    assert_state_equal(full, saved[0])
    assert scheduler == saved[1] and scheduler["last_epoch"] == 3
    assert position == saved[2] == 24
    assert torch.equal(rng, saved[3])


# -- dcp-zarr list / prune -----------------------------------------------------------------------------------------


def _filled_root(root) -> None:
    with CheckpointManager(root) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, state(step))
    (root / STAGING_DIR / f"{step_name(5)}{STAGING_MARK}dead").mkdir(parents=True)  # a save that was killed


def test_list_shows_steps_sizes_completeness_leftovers_and_the_holder(tmp_path, capsys):
    from dcp_zarr.tools.cli import main

    _filled_root(tmp_path)
    (tmp_path / "step-00000009.zarr").mkdir()  # not a checkpoint: listed, never counted
    assert main(["list", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["complete"]) for r in listing["steps"]] == [(1, True), (2, True), (3, True), (4, True),
                                                                     (9, False)]
    assert all(r["nbytes"] > 0 for r in listing["steps"][:4]) and listing["held"] is None
    assert listing["leftovers"] == [f"{STAGING_DIR}/{step_name(5)}{STAGING_MARK}dead"]
    assert [(r["state"], r["detail"]) for r in listing["steps"]][3:] == [
        ("complete", None),
        ("incomplete", "no committed zarr.json: its save was interrupted, or is still running; nothing loads it. "
                       f"Remove it once no job saves here: rm -r {tmp_path / 'step-00000009.zarr'}")]
    with CheckpointManager(tmp_path):
        assert main(["list", str(tmp_path)]) == 0
        out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path}: 5 checkpoints, 4 complete"
    assert lines[1].startswith("  in use: a CheckpointManager holds it (held by manager ")
    assert lines[1].endswith("); `dcp-zarr prune` refuses until that job stops")
    assert lines[2].split() == ["1", "step-00000001.zarr", *lines[2].split()[2:4], "complete"]
    assert lines[6].split()[-1] == "incomplete" and lines[7].strip().startswith("no committed zarr.json: ")
    assert main(["list", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == ("  not in use: no CheckpointManager holds it now, so "
                                                       "`dcp-zarr prune` may run")


def test_list_flags_a_step_folder_holding_both_a_store_and_dcps_files(tmp_path, capsys):
    """A torchtitan run switched back to DCP's own checkpointing writes .metadata and .distcp files into the step
    folders it finds, committed zarr stores among them: listed as mixed, with what loads and how to keep one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from dcp_zarr import ZarrWriter
    from dcp_zarr.tools.cli import main

    for step in (5, 6):
        dcp.save(state(step), storage_writer=ZarrWriter(str(tmp_path / f"step-{step}")), planner=ZarrSavePlanner())
    dcp.save(state(6), storage_writer=FileSystemWriter(str(tmp_path / "step-6")))

    assert main(["list", str(tmp_path), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows[5]["state"] == "complete" and rows[5]["mixed"] is None
    folder = tmp_path / "step-6"
    assert rows[6]["complete"] and rows[6]["state"] == "mixed: a dcp_zarr store and DCP's files"
    assert rows[6]["mixed"] == (
        "holds both a committed dcp_zarr store and DCP's files (.metadata and 1 .distcp file), as a run that "
        "switched back to DCP's own checkpointing leaves it; torchtitan's resume loads DCP's files, not the store, "
        f"and `dcp-zarr inspect` refuses the folder. Keep one: rm {folder}/.metadata {folder}/*.distcp keeps the "
        "zarr store")
    assert main(["list", str(tmp_path)]) == 0
    assert "mixed: a dcp_zarr store and DCP's files" in capsys.readouterr().out

    assert main(["inspect", str(folder)]) == 2
    assert capsys.readouterr().err == f"dcp-zarr inspect: error: {folder} {rows[6]['mixed']}\n"
    for name in os.listdir(folder):
        if name == ".metadata" or name.endswith(".distcp"):
            os.remove(folder / name)
    assert main(["inspect", str(folder)]) == 0  # the zarr store kept


def test_prune_dry_run_deletes_nothing_and_prune_keeps_what_the_manager_would(tmp_path, capsys):
    from dcp_zarr.tools.cli import main

    _filled_root(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert main(["prune", str(tmp_path), "--keep-last", "1", "--keep-every", "2", "--dry-run"]) == 0
    assert "would delete 2 checkpoint(s)" in capsys.readouterr().out and sorted(os.listdir(tmp_path)) == before

    assert main(["prune", str(tmp_path), "--keep-last", "1", "--keep-every", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["deleted"] == [1, 3] and result["kept"] == [2, 4]
    assert result["leftovers_removed"] == [f"{STAGING_DIR}/{step_name(5)}{STAGING_MARK}dead"]
    with CheckpointManager(tmp_path) as manager:
        assert manager.steps() == [2, 4] and saved_step(manager, 2) == 2


def test_prune_refuses_while_a_manager_holds_the_root(tmp_path, capsys):
    from dcp_zarr.tools.cli import main

    _filled_root(tmp_path)
    with CheckpointManager(tmp_path) as manager:
        assert main(["prune", str(tmp_path), "--keep-last", "1"]) == 2
        assert "is held by manager" in capsys.readouterr().err
        assert manager.steps() == [1, 2, 3, 4]


def _accelerate_checkpoints(root) -> None:
    """accelerate's checkpoints/ as ZarrAccelerator leaves it: checkpoint_8 written by accelerate itself (DCP), 9 and
    10 complete, 11 killed before the model's commit, 12 killed while the optimizer was saved (its model whole)."""
    import torch.distributed.checkpoint as dcp

    from dcp_zarr import ZarrWriter

    def folder(number, stores=(), finished=True):
        path = root / f"checkpoint_{number}"
        path.mkdir(parents=True)
        for name in stores:
            dcp.save(state(number), storage_writer=ZarrWriter(str(path / name)), planner=ZarrSavePlanner())
        if finished:  # rank 0's, written after every store of the save
            for rank in (0, 1):
                (path / f"random_states_{rank}.pkl").write_bytes(b"rng")
        return path

    accelerates_own = folder(8)
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        (accelerates_own / name).mkdir()
        (accelerates_own / name / ".metadata").write_bytes(b"dcp")
    folder(9, ("pytorch_model_fsdp_0", "optimizer_0"))
    folder(10, ("pytorch_model_fsdp_0", "optimizer_0"))
    killed_early = folder(11, finished=False)
    (killed_early / STAGING_DIR / f"pytorch_model_fsdp_0{STAGING_MARK}0a").mkdir(parents=True)
    folder(12, ("pytorch_model_fsdp_0",), finished=False)


def test_list_shows_accelerates_checkpoint_folders_complete_or_interrupted(tmp_path, capsys):
    from dcp_zarr.tools.cli import main

    _accelerate_checkpoints(tmp_path)
    assert main(["list", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(r["store"], r["complete"], r["other_format"]) for r in listing["steps"]] == [
        ("checkpoint_8", False, "DCP checkpoints accelerate wrote itself"), ("checkpoint_9", True, None),
        ("checkpoint_10", True, None), ("checkpoint_11", False, None), ("checkpoint_12", False, None)]
    assert all(r["nbytes"] > 0 for r in listing["steps"] if r["complete"]) and listing["leftovers"] == []
    rows = {r["store"]: r for r in listing["steps"]}
    assert rows["checkpoint_8"]["state"] == "not dcp_zarr: DCP checkpoints accelerate wrote itself"
    assert rows["checkpoint_12"]["detail"] == (
        "random_states_0.pkl, which accelerate writes after every store of a save, is missing; nothing loads it. "
        f"Remove it once no job saves here: rm -r {tmp_path / 'checkpoint_12'}")
    assert main(["list", str(tmp_path)]) == 0
    assert "checkpoint_12" in capsys.readouterr().out


def test_prune_deletes_accelerates_older_complete_folders_whole_and_leaves_the_rest(tmp_path, capsys):
    """Interrupted folders stay (accelerate holds no lease, so one may be a save in progress); accelerate's own DCP
    folders are not counted; and nothing of dcp_zarr's stays in the folder, whose every entry accelerate's
    total_limit takes for a checkpoint_N."""
    from dcp_zarr.tools.cli import main

    _accelerate_checkpoints(tmp_path)
    assert main(["prune", str(tmp_path), "--keep-last", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["deleted"] == [9] and result["kept"] == [10] and result["leftovers_removed"] == []
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_10", "checkpoint_11", "checkpoint_12", "checkpoint_8"]
    assert sorted(os.listdir(tmp_path / "checkpoint_10")) == ["optimizer_0", "pytorch_model_fsdp_0",
                                                              "random_states_0.pkl", "random_states_1.pkl"]


def test_a_manager_neither_lists_nor_loads_accelerates_folders(tmp_path):
    _accelerate_checkpoints(tmp_path)
    with CheckpointManager(tmp_path) as manager:
        assert manager.steps() == [] and manager.latest_step() is None
        with pytest.raises(StepNotFoundError, match="no complete checkpoint"):
            manager.load({"w": torch.zeros(4, 3)})
    assert RECORDS not in os.listdir(tmp_path)


def test_list_and_prune_need_no_torch(tmp_path):
    _filled_root(tmp_path)
    script = ("import sys; sys.modules['torch'] = None\nfrom dcp_zarr.tools.cli import main\n"
              f"assert main(['list', {str(tmp_path)!r}]) == 0\n"
              f"assert main(['prune', {str(tmp_path)!r}, '--keep-last', '2']) == 0\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "deleted 2 checkpoint(s)" in done.stdout


@pytest.mark.parametrize("argv, match", [
    (["prune", "{root}", "--keep-last", "0"], "--keep-last"),
    (["prune", "{root}"], "--keep-last"),
    (["list", "{root}/missing"], "does not exist"),
])
def test_list_and_prune_refuse_bad_arguments_by_name(tmp_path, capsys, argv, match):
    from dcp_zarr.tools.cli import main

    argv = [a.format(root=tmp_path) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2 and match in capsys.readouterr().err
