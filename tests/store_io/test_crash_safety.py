"""A save killed at any moment never leaves a checkpoint that loads as complete when it is not, never damages an
earlier checkpoint, and never mixes two checkpoints; and what is committed was fsynced first.

The kill trials save two-rank DTensor state dicts (tests/support/faults.py) and SIGKILL ranks

* at every filesystem mutation of a save, one at a time (chunk and zarr.json writes, some torn halfway, the
  directory fsyncs, the commit rename or exchange, and a sample of the unlinks that remove a replaced checkpoint),
  of the coordinator and of the other rank, into a fresh path and over an existing checkpoint;
* at random moments from outside, one rank or all of them;
* while a second save into another store in the same directory runs, which must not notice.

After every trial the target must be absent (fresh path) or load bit-exact as the previous or the new checkpoint (and
pass ``dcp-zarr verify``);
an earlier checkpoint at another path must be byte-identical; every hidden staging directory left behind must either
refuse to load as a checkpoint or load bit-exact as one of the two. The counts are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
import warnings
from collections import Counter

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import CheckpointExistsError, MalformedMetadataError, NotACheckpointError, ZarrReader, ZarrWriter
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.storage import LocalStorage
from dcp_zarr.store_io import commit as commit_module
from dcp_zarr.store_io.commit import STAGING_DIR, STAGING_MARK
from dcp_zarr.store_io.root_document import read_manifest
from dcp_zarr.tools.verify import verify_checkpoint
from tests.support.compare import assert_state_equal
from tests.support.faults import causes, crash_state, load_program, save_program
from tests.support.states import blank_like, load_full, save_plain
from tests.support.stores import tree_digest

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

WORLD_SIZE = 2
TRIAL_SEED = 20260601
TEMPLATE = crash_state(0)
_STATES: dict[int, dict] = {}


def state_of(seed: int) -> dict:
    if seed not in _STATES:
        _STATES[seed] = crash_state(seed)
    return _STATES[seed]


class Workspace:
    """One directory with a target that trials save into, and an earlier checkpoint beside it that nothing may touch."""

    def __init__(self, root: str, name: str = "ckpt.zarr"):
        self.root = root
        self.target = os.path.join(root, name)
        self.staging_prefix = f"{name}{STAGING_MARK}"  # in STAGING_DIR beside the target
        self.sentinel = os.path.join(root, "earlier.zarr")
        save_plain(state_of(1), self.sentinel)
        self.sentinel_digest = tree_digest(self.sentinel)
        self.committed: int | None = None
        self.leftovers: set[str] = set()
        self.others: set[str] = set()  # other stores in the directory, not this workspace's business
        self.outcomes: Counter = Counter()
        self.leftover_outcomes: Counter = Counter()

    def prepare(self, fresh: bool) -> int | None:
        if fresh and os.path.exists(self.target):
            shutil.rmtree(self.target)
            self.committed = None
        return self.committed

    def check(self, new_seed: int, label: str, count: bool = True) -> str:
        """Assert every invariant after a trial that saved ``new_seed``; returns "old", "new" or "absent"."""
        old = self.committed
        candidates = [s for s in (old, new_seed) if s is not None]
        if not os.path.exists(self.target):
            assert old is None, f"{label}: the previous checkpoint (seed {old}) at the target is gone"
            outcome = "absent"
        else:
            seed = _matching_seed(self.target, candidates, label)
            outcome = "new" if seed == new_seed and seed != old else "old"
            self.committed = seed
            report = verify_checkpoint(open_checkpoint(self.target))
            assert report.ok, f"{label}: dcp-zarr verify finds problems: {[str(p) for p in report.problems]}"
        assert tree_digest(self.sentinel) == self.sentinel_digest, f"{label}: the earlier checkpoint was modified"
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if path in (self.target, self.sentinel) or name in self.others:
                continue
            assert name == STAGING_DIR, f"{label}: unexpected {name!r} beside the target"
            for staged in sorted(os.listdir(path)):
                if staged in self.leftovers:
                    continue
                assert staged.startswith(self.staging_prefix), f"{label}: unexpected {name}/{staged!r}"
                self.leftovers.add(staged)
                self.leftover_outcomes[_leftover_state(os.path.join(path, staged), candidates, label)] += 1
        if count:
            self.outcomes[outcome] += 1
        return outcome


def _matching_seed(path: str, candidates: list[int], label: str) -> int:
    """The seed whose state ``path`` loads as, bit-exact; fails unless it is one of ``candidates``."""
    try:
        loaded = load_full(path, TEMPLATE)
    except BaseException as exc:  # CheckpointException is a BaseException
        raise AssertionError(f"{label}: {path} does not load: {[repr(c) for c in causes(exc)]}") from None
    differences = []
    for seed in candidates:
        try:
            assert_state_equal(loaded, state_of(seed))
            return seed
        except AssertionError as exc:
            differences.append(f"seed {seed}: {exc}")
    raise AssertionError(f"{label}: {path} loads, but as none of seeds {candidates}: {differences}")


def _leftover_state(path: str, candidates: list[int], label: str) -> str:
    """A staging directory left by a killed save: either not a checkpoint at all, or a complete one."""
    try:
        read_manifest(LocalStorage(path))
    except (NotACheckpointError, MalformedMetadataError):
        with pytest.raises((NotACheckpointError, MalformedMetadataError)):
            open_checkpoint(path)  # what dcp-zarr verify opens
        return "refused"
    _matching_seed(path, candidates, f"{label}: leftover {os.path.basename(path)}")
    return "complete"


def _run_trial(zygote, ws: Workspace, seed: int, kill: dict | None = None, timer: tuple | None = None,
               options: dict | None = None):
    """One save of ``seed``; ``kill`` for a self-kill at an event, ``timer=(delay, ranks)`` for a kill from outside;
    ``options``: the writer's, over the trials' own."""
    launch = zygote.launch(save_program, WORLD_SIZE, ws.target, seed, kill, options)
    if timer is not None:
        delay, ranks = timer
        assert launch.wait_reported("saving", 60, ranks=[0]), "rank 0 never started saving"
        time.sleep(delay)
        launch.kill(ranks)
    return launch.wait(60)


def _save_completely(zygote, ws: Workspace, seed: int, options: dict | None = None) -> list[list[str]]:
    outcomes = _run_trial(zygote, ws, seed, options=options)
    assert all(o[0] == "ok" for o in outcomes.values()), outcomes
    ws.check(seed, f"clean save of seed {seed}", count=False)
    assert ws.committed == seed
    return [outcomes[r][1] for r in range(WORLD_SIZE)]


def _kill_points(sequences: list[list[str]]) -> list[dict]:
    """Every event of every rank; every write twice: killed before it, and halfway through it (a torn file)."""
    points = []
    for rank, sequence in enumerate(sequences):
        for i, kind in enumerate(sequence, 1):
            points.append({"rank": rank, "event": i, "kind": kind, "torn": False})
            if kind == "write":
                points.append({"rank": rank, "event": i, "kind": kind, "torn": True})
    return points


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_at_every_io_step_of_a_save_never_commits_a_partial_checkpoint(zygote, tmp_path):
    ws = Workspace(str(tmp_path))
    seeds = iter(range(100, 10_000))
    started = time.monotonic()
    outcome_by_kind: dict[str, Counter] = {}
    trials = 0
    for fresh in (True, False):
        ws.prepare(fresh=True)
        if not fresh:
            _save_completely(zygote, ws, next(seeds))  # so that the measured save below replaces a checkpoint
        sequences = _save_completely(zygote, ws, next(seeds))  # each rank's events, in order
        for point in _kill_points(sequences):
            ws.prepare(fresh=fresh)
            seed = next(seeds)
            outcomes = _run_trial(zygote, ws, seed, kill=point)
            label = (f"{'fresh' if fresh else 'overwrite'} trial, rank {point['rank']} killed at event "
                     f"{point['event']} ({point['kind']}{', torn' if point['torn'] else ''})")
            assert outcomes[point["rank"]][0] == "died", f"{label}: the kill point was never reached: {outcomes}"
            outcome = ws.check(seed, label)
            kind = point["kind"] + (" (torn)" if point["torn"] else "")
            outcome_by_kind.setdefault(kind, Counter())[outcome] += 1
            trials += 1
    elapsed = time.monotonic() - started
    print(f"\nkill at an IO step: {trials} trials in {elapsed:.1f} s; target after the kill: {dict(ws.outcomes)}; "
          f"leftover staging dirs: {dict(ws.leftover_outcomes)}")
    for kind, counts in sorted(outcome_by_kind.items()):
        print(f"  {kind:16s} {dict(counts)}")
    # Kills before the commit keep the old checkpoint (or none); kills after it (removing the replaced one, the
    # final directory fsync) find the new one. Both must have happened, or the trials did not straddle the commit.
    assert ws.outcomes["new"] > 0 and (ws.outcomes["old"] + ws.outcomes["absent"]) > 0
    assert outcome_by_kind["write"].keys() <= {"old", "absent"}, "a kill during the writes committed something"


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_at_each_exchange_of_an_aggregated_save_or_a_shared_load_leaves_the_checkpoint_as_it_was(
        zygote, tmp_path):
    """Collective I/O (issue 25): a rank killed as it enters a round of an aggregated save's exchange leaves the
    previous checkpoint (or none) and no staging area that loads as complete; one killed in a load's shared reads
    leaves the store untouched, and the other rank fails instead of waiting for it."""
    ws = Workspace(str(tmp_path))
    options = {"aggregate_below": 1 << 40, "exchange_bytes": 4096}  # every array aggregated, in several rounds
    seeds = iter(range(20_000, 30_000))
    trials = Counter()
    for fresh in (True, False):
        ws.prepare(fresh=True)
        if not fresh:
            _save_completely(zygote, ws, next(seeds), options)
        sequences = _save_completely(zygote, ws, next(seeds), options)
        points = [{"rank": rank, "event": i, "kind": kind} for rank, sequence in enumerate(sequences)
                  for i, kind in enumerate(sequence, 1) if kind == "transfer"]
        assert len(points) >= 2 * WORLD_SIZE, f"too few rounds to kill in: {sequences}"
        for point in points:
            ws.prepare(fresh=fresh)
            seed = next(seeds)
            outcomes = _run_trial(zygote, ws, seed, kill=point, options=options)
            label = f"aggregated save, rank {point['rank']} killed at exchange event {point['event']}"
            assert outcomes[point["rank"]][0] == "died", f"{label}: {outcomes}"
            trials[f"save: {ws.check(seed, label)}"] += 1
    assert set(trials) <= {"save: old", "save: absent"}, trials
    before = tree_digest(ws.target)
    reading = {"read_once": True, "read_once_below": 1 << 40, "exchange_bytes": 4096}
    clean = zygote.launch(load_program, WORLD_SIZE, ws.target, None, reading).wait(60)
    assert all(o[0] == "ok" for o in clean.values()), clean
    for rank in range(WORLD_SIZE):
        for event, kind in enumerate(clean[rank][1], 1):
            if kind != "transfer":
                continue
            point = {"rank": rank, "event": event}
            outcomes = zygote.launch(load_program, WORLD_SIZE, ws.target, point, reading).wait(60)
            label = f"shared load, rank {rank} killed at exchange event {event}"
            assert outcomes[rank][0] == "died", f"{label}: {outcomes}"
            assert outcomes[1 - rank][0] == "raised", f"{label}: the other rank did not fail by itself: {outcomes}"
            assert tree_digest(ws.target) == before, f"{label}: the store changed"
            trials["load: store untouched"] += 1
    _matching_seed(ws.target, [ws.committed], "after the load trials")
    print(f"\nkill at an exchange: {dict(trials)}; leftover staging dirs: {dict(ws.leftover_outcomes)}")


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_at_random_moments_of_one_rank_or_all(zygote, tmp_path):
    rng = random.Random(TRIAL_SEED + 1)
    ws = Workspace(str(tmp_path))
    save_started = time.monotonic()
    _save_completely(zygote, ws, 1000)
    clean = time.monotonic() - save_started  # launch + save + exit: kill delays are spread over all of it
    trials, victims = 100, Counter()
    started = time.monotonic()
    for trial in range(trials):
        fresh = rng.random() < 0.25
        ws.prepare(fresh=fresh)
        ranks = None if rng.random() < 0.5 else [rng.randrange(WORLD_SIZE)]
        victims["all" if ranks is None else f"rank {ranks[0]}"] += 1
        seed = 1001 + trial
        _run_trial(zygote, ws, seed, timer=(rng.uniform(0, clean), ranks))
        ws.check(seed, f"trial {trial}: {'all ranks' if ranks is None else f'rank {ranks[0]}'} killed")
    print(f"\nkill at a random moment: {trials} trials in {time.monotonic() - started:.1f} s, victims {dict(victims)}; "
          f"target after the kill: {dict(ws.outcomes)}; leftover staging dirs: {dict(ws.leftover_outcomes)}")


@pytest.mark.slow
@pytest.mark.distributed
def test_concurrent_saves_into_different_stores_are_independent(zygote, tmp_path):
    """Two saves into sibling stores at once; one is killed (at an IO step, or at a random moment), the other must
    not notice."""
    rng = random.Random(TRIAL_SEED + 2)
    killed_ws = Workspace(str(tmp_path), "a.zarr")
    survivor = os.path.join(str(tmp_path), "b.zarr")
    killed_ws.others.add("b.zarr")
    sequences = _save_completely(zygote, killed_ws, 1999)
    trials = 12
    for trial in range(trials):
        seed = 2000 + trial
        rank = rng.randrange(WORLD_SIZE)
        kill = {"rank": rank, "event": rng.randint(1, len(sequences[rank])), "torn": rng.random() < 0.5}
        kept = zygote.launch(save_program, WORLD_SIZE, survivor, seed, None)
        victim = zygote.launch(save_program, WORLD_SIZE, killed_ws.target, seed + 100, kill if trial % 2 else None)
        if trial % 2 == 0:  # from outside, at a random moment of the save
            assert victim.wait_reported("saving", 60, ranks=[0])
            time.sleep(rng.uniform(0, 0.3))
            victim.kill(None if trial % 4 else [rank])
        outcomes = kept.wait(60)
        assert all(o[0] == "ok" for o in outcomes.values()), f"trial {trial}: the other save failed: {outcomes}"
        victim.wait(30)
        assert_state_equal(load_full(survivor, TEMPLATE), state_of(seed))
        killed_ws.check(seed + 100, f"concurrent trial {trial}")
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".b.zarr")], "the finished save left staging behind"
    print(f"\nconcurrent saves: {trials} trials; killed store after the kill: {dict(killed_ws.outcomes)}; "
          f"the other store loaded bit-exact {trials}/{trials}")


# -- durability: what is fsynced, and in which order ------------------------------------------------------------------


def _record_durability(monkeypatch) -> list[tuple]:
    """Log, in call order, of ("write", path), ("fsync", path), ("syncfs", path), ("rename", src, dst) and
    ("exchange", a, b) during a save in this process."""
    from dcp_zarr.storage import local

    log: list[tuple] = []
    lock = threading.Lock()

    def record(*entry):
        with lock:
            log.append(entry)

    real_write, real_fsync, real_rename, real_exchange = local.LocalStorage.write, os.fsync, os.rename, \
        commit_module._exchange

    def write(self, key, buffers):
        real_write(self, key, buffers)
        record("write", self._path(key))

    def fsync(fd):
        record("fsync", os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        record("rename", os.fspath(src), os.fspath(dst))
        return real_rename(src, dst, *args, **kwargs)

    def exchange(a, b):
        record("exchange", a, b)
        return real_exchange(a, b)

    monkeypatch.setattr(local.LocalStorage, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(commit_module, "_exchange", exchange)
    if hasattr(local, "_syncfs"):  # one syncfs per rank flushes every file and directory on that filesystem
        real_syncfs = local._syncfs

        def syncfs(path):
            real_syncfs(path)
            record("syncfs", path)

        monkeypatch.setattr(local, "_syncfs", syncfs)
    return log


def _tree(root: str) -> tuple[set[str], set[str]]:
    files, dirs = set(), {root}
    for dirpath, dirnames, filenames in os.walk(root):
        dirs.update(os.path.join(dirpath, d) for d in dirnames)
        files.update(os.path.join(dirpath, f) for f in filenames)
    return files, dirs


def _durable_before(log: list[tuple], end: int, files: set[str], dirs: set[str], staging: str) -> list[str]:
    """Paths (staging names) not made durable by ``log[:end]``: each needs an fsync of its own after its last
    write (directories: after the last write of all), or a syncfs of the staging tree after that."""
    last_write: dict[str, int] = {}
    for i, entry in enumerate(log[:end]):
        if entry[0] == "write":
            last_write[entry[1]] = i
    final_write = max(last_write.values())
    syncs = [i for i, entry in enumerate(log[:end]) if entry[0] == "syncfs" and entry[1].startswith(staging)]
    fsyncs: dict[str, int] = {}
    for i, entry in enumerate(log[:end]):
        if entry[0] == "fsync":
            fsyncs[entry[1]] = i
    missing = []
    for path in files | dirs:
        written = last_write.get(path, final_write) if path in files else final_write
        if not (fsyncs.get(path, -1) > written or any(i > written for i in syncs)):
            missing.append(path)
    return sorted(missing)


@pytest.mark.parametrize("replacing", [False, True], ids=["fresh", "replacing"])
def test_every_file_and_directory_is_fsynced_before_the_commit_and_the_parent_after(tmp_path, monkeypatch, replacing):
    target = str(tmp_path / "ckpt.zarr")
    if replacing:
        save_plain(state_of(5), target)
    log = _record_durability(monkeypatch)
    save_plain(state_of(6), target, overwrite=True, inner_chunk_bytes=2048)
    commits = [i for i, entry in enumerate(log) if entry[0] in ("rename", "exchange") and entry[2] == target]
    assert len(commits) == 1, log
    at = commits[0]
    staging = log[at][1]
    assert os.path.basename(staging).startswith(f"ckpt.zarr{STAGING_MARK}")
    assert os.path.dirname(staging) == str(tmp_path / STAGING_DIR)
    files, dirs = _tree(target)
    as_staged = lambda paths: {p.replace(target, staging, 1) for p in paths}  # noqa: E731
    missing = _durable_before(log, at, as_staged(files), as_staged(dirs), staging)
    assert not missing, f"not durable before the commit: {missing}"
    after = [entry for entry in log[at + 1:] if entry[0] == "fsync"]
    assert after and after[0][1] == str(tmp_path), "the parent directory must be fsynced right after the commit"
    assert_state_equal(load_full(target, TEMPLATE), state_of(6))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.zarr"]


def test_sync_files_false_commits_the_same_way_without_fsync(tmp_path, monkeypatch):
    target = str(tmp_path / "ckpt.zarr")
    log = _record_durability(monkeypatch)
    save_plain(state_of(7), target, sync_files=False)
    assert [e for e in log if e[0] == "rename" and e[2] == target], "still committed by a rename"
    staged = [e for e in log if e[0] in ("fsync", "syncfs") and STAGING_MARK in e[1]]
    assert staged == [], f"sync_files=False still synced {staged}"
    assert_state_equal(load_full(target, TEMPLATE), state_of(7))


# -- the overwrite policy --------------------------------------------------------------------------------------------


class _SaveElsewhereFirst(dcp.DefaultSavePlanner):
    """While this save writes, another one commits a checkpoint at the same path (it was free when we started)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def finish_plan(self, plan):
        save_plain(state_of(9), self.path)
        return super().finish_plan(plan)


def test_a_checkpoint_that_appears_during_a_save_is_not_replaced_without_overwrite(tmp_path):
    target = str(tmp_path / "ckpt.zarr")
    with pytest.raises(CheckpointException) as info:
        dcp.save(state_of(8), storage_writer=ZarrWriter(target, overwrite=False), planner=_SaveElsewhereFirst(target))
    (refused,) = [c for c in causes(info.value) if isinstance(c, CheckpointExistsError)]
    assert str(refused).startswith(f"Checkpoint already exists: {target} was written by someone else while this "
                                   "save ran")
    assert "this save was discarded. Load that checkpoint, or save again with overwrite=True" in str(refused)
    assert_state_equal(load_full(target, TEMPLATE), state_of(9))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.zarr"], "the refused save's staging directory is removed"


def test_an_incomplete_store_at_the_target_is_refused_on_load_and_never_replaced(tmp_path):
    target = str(tmp_path / "ckpt.zarr")
    save_plain(state_of(3), target)
    os.remove(os.path.join(target, "zarr.json"))  # a store whose commit marker never arrived
    with pytest.raises(CheckpointException, match="incomplete"):
        dcp.load(blank_like(TEMPLATE), storage_reader=ZarrReader(target))
    with pytest.raises(CheckpointException) as info:
        save_plain(state_of(4), target)
    assert isinstance(causes(info.value)[0], CheckpointExistsError), "nothing is replaced silently"
    assert not os.path.exists(os.path.join(target, "zarr.json"))


# -- what a refused save says: the thing at fault, what happened, what to do ----------------------------------------


def _interrupt(target: str, how: str) -> None:
    """A store whose save stopped before its commit: no root zarr.json, or one whose manifest is not complete."""
    save_plain(state_of(3), target)
    root = os.path.join(target, "zarr.json")
    if how == "no root zarr.json":
        os.remove(root)
        return
    with open(root) as f:
        document = json.load(f)
    document["attributes"]["dcp_zarr"]["complete"] = False
    with open(root, "w") as f:
        json.dump(document, f)


@pytest.mark.parametrize("how", ["no root zarr.json", "manifest not complete"])
def test_a_save_onto_an_interrupted_save_names_it_and_says_remove_it_or_overwrite(tmp_path, how):
    target = str(tmp_path / "ckpt.zarr")
    _interrupt(target, how)

    with pytest.raises(CheckpointException) as info:
        save_plain(state_of(4), target)

    (refused,) = causes(info.value)
    assert isinstance(refused, CheckpointExistsError)
    assert str(refused).startswith(f"{target} holds an interrupted dcp_zarr save, not a checkpoint (")
    assert "its save stopped before the commit, so nothing loads it" in str(refused)
    assert str(refused).endswith(f"Remove it (rm -r {target}), or save with overwrite=True "
                                 "(ZarrWriter(..., overwrite=True)) to replace it")
    assert "not a dcp_zarr checkpoint" not in str(refused)
    assert not os.path.exists(os.path.join(target, "zarr.json")) or how == "manifest not complete"


@pytest.mark.parametrize("how", ["no root zarr.json", "manifest not complete"])
def test_only_an_explicit_overwrite_lets_a_save_replace_an_interrupted_one(tmp_path, how):
    target = str(tmp_path / "ckpt.zarr")
    _interrupt(target, how)

    with pytest.raises(CheckpointExistsError, match="interrupted dcp_zarr save"):
        commit_module.check_target(target, None, True)  # a local save's default: complete checkpoints only
    commit_module.check_target(target, None, True, replace_interrupted=True)


def test_overwrite_true_replaces_an_interrupted_save(tmp_path):
    target = str(tmp_path / "ckpt.zarr")
    _interrupt(target, "no root zarr.json")

    save_plain(state_of(4), target, overwrite=True)

    assert_state_equal(load_full(target, TEMPLATE), state_of(4))


def test_a_save_onto_a_file_or_foreign_data_says_what_is_there_and_what_to_do(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"weights")
    with pytest.raises(CheckpointExistsError) as info:
        commit_module.check_target(str(path), None, True)
    assert str(info.value) == (f"{path} is a file, not a checkpoint directory; a save there would replace it, so it "
                               "is refused. Save to another path, or remove the file first")

    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointExistsError) as info:
        commit_module.check_target(str(data), None, True, replace_interrupted=True)
    assert str(info.value).startswith(f"{data} holds data that is not a dcp_zarr checkpoint ({data} is not a "
                                      "dcp_zarr checkpoint: there is no zarr.json at its root)")
    assert str(info.value).endswith("so it is refused, with overwrite=True too. Save to a new or empty path, or "
                                    "move that data away first")


def test_a_save_onto_a_complete_checkpoint_without_overwrite_says_how_to_replace_it(tmp_path):
    target = str(tmp_path / "ckpt.zarr")
    save_plain(state_of(3), target)

    with pytest.raises(CheckpointExistsError) as info:
        commit_module.check_target(target, None, False)

    assert str(info.value).startswith(f"Checkpoint already exists: {target} already holds a checkpoint; pass "
                                      "overwrite=True to ZarrWriter to replace it")
    assert str(info.value).endswith("or save to another path")
