"""A kill at any moment of torchtitan's ``keep_latest_k`` purge, as the adapter deletes: every newer step still loads,
and the next manager finishes the deletion.

A one-rank torchtitan job (``ZarrCheckpointManager``, ``keep_latest_k=2``) saves steps 1 to 3, each with its own
weights; ``save(3)`` makes step 1 stale, and the adapter's retention thread deletes it while ``close()`` waits. The
kill hook of the manager's trials (tests/lifecycle/test_background_deletion_kills.py: ``DeletionKills``) counts what
the deletion does to the folder (the rename aside, each file and folder removed, the staging directory) and SIGKILLs
the job at a chosen one. A fresh job then loads steps 2 and 3 equal to what was saved under them, finds step 1 only
where the kill came before its rename (and loads it too), saves step 4, and closes with nothing left but steps 3
and 4: its purge finished the killed deletion before its own.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.integrations.test_background_retention import _titan_manager
from tests.lifecycle.test_background_deletion_kills import (
    DeletionKills,
    _started,
    first_deletion,
    local_kill_points,
    logged,
    phase,
)

pytestmark = [pytest.mark.frameworks, pytest.mark.distributed, pytest.mark.slow]

KILL_POINTS = ("before the rename", "after the rename", "half of the files removed",
               "before the staging directory's removal", "the deletion finished")


def _model() -> torch.nn.Module:
    # enough arrays that the deletion removes some dozens of files, for kills inside it
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])


def _fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)


def _holds(model: torch.nn.Module, value: float) -> bool:
    return all(torch.equal(p, torch.full_like(p, value)) for p in model.parameters())


def _purging_job(rank: int, world_size: int, report, base: str, log_dir: str, kill: dict | None) -> None:
    """Rank program: steps 1 to 3 saved, step 1 purged; the retention thread runs ``DeletionKills``."""
    with open(os.path.join(log_dir, f"rank{rank}.pid"), "w") as f:
        f.write(f"{os.getpid()} {_started(os.getpid())}")
    DeletionKills(log_dir, world_size, kill, None)
    model = _model()
    manager = _titan_manager(base, model=model)
    for step in (1, 2, 3):
        _fill(model, step)
        manager.save(step)
    manager.close()


def _next_job(rank: int, world_size: int, report, base: str) -> dict:
    """Rank program: what a fresh manager finds after the kill, loads, and leaves once it saved step 4."""
    folder = os.path.join(base, "checkpoint")
    listed = sorted(n for n in os.listdir(folder) if n.startswith("step-"))
    model = _model()
    manager = _titan_manager(base, model=model)
    loaded = {}
    for name in listed:
        step = int(name.removeprefix("step-"))
        _fill(model, 0)
        manager.load(step=step)
        loaded[step] = _holds(model, step)
    _fill(model, 4)
    manager.save(4)
    manager.close()
    return {"listed": listed, "loaded": loaded, "left": sorted(os.listdir(folder))}


def test_a_kill_anywhere_in_a_torchtitan_purge_leaves_the_newer_steps_and_the_next_manager_finishes_it(
        zygote, tmp_path):
    pytest.importorskip("torchtitan")
    launches = iter(range(1000))

    def launch(fn, *args):
        outcomes = zygote.launch(fn, 1, *args).wait(180)
        return outcomes[0]

    def purge(base: str, kill: dict | None) -> tuple[tuple, list[str]]:
        log_dir = str(tmp_path / "logs" / str(next(launches)))
        os.makedirs(log_dir)
        return launch(_purging_job, base, log_dir, kill), logged(log_dir)

    outcome, events = purge(str(tmp_path / "probe"), None)
    assert outcome[0] == "ok", outcome
    deletion = first_deletion(events, 1)
    points = dict(local_kill_points(deletion, None))
    report = {}
    for n, name in enumerate(KILL_POINTS):
        base, label = str(tmp_path / f"trial{n}"), f"killed {name}"
        outcome, events = purge(base, points[name])
        assert outcome[0] == "died", f"{label}: the kill point was never reached: {outcome}"
        assert "begin 1" in events, f"{label}: killed outside the deletion of step 1: {events}"
        outcome = launch(_next_job, base)
        assert outcome[0] == "ok", f"{label}: the next manager failed: {outcome}"
        seen = outcome[1]
        report[name] = f"{phase(events, 1)}: listed {seen['listed']}"
        expected = ["step-1", "step-2", "step-3"] if name == "before the rename" else ["step-2", "step-3"]
        assert seen["listed"] == expected, f"{label}: the next manager found {seen['listed']}"
        assert all(seen["loaded"].values()), f"{label}: steps that did not load as saved: {seen['loaded']}"
        assert seen["left"] == ["step-3", "step-4"], f"{label}: the next manager left {seen['left']}"
    print("\nkilled in a torchtitan purge:\n  " + "\n  ".join(f"{k}: {v}" for k, v in report.items()))
