"""The frameworks' retention, as the adapters run it: a save never waits for the deletion of a checkpoint it made
stale, and the adapter's teardown waits for that deletion. Lightning's ``ModelCheckpoint`` removes in the strategy's
``remove_checkpoint``, on the training's thread: the adapter's Trainer strategies take it off that thread
(dcp_zarr.integrations.lightning). torchtitan's ``keep_latest_k`` purge runs on a thread, which ``close()`` joins: the
adapter deletes each stale ``step-N`` crash-safely (renamed aside first) on a thread of its own, and raises a deletion
that failed. A kill in the middle of such a deletion is tried in tests/integrations/test_torchtitan_purge_kills.py.

Each deletion is slowed down: it waits (at most 20 s) for the training to go on past the save that made it stale,
or to end, then for 0.3 s more. Run on the training's thread, it would find neither (and say so); and a teardown that
did not wait for it would return while the stale checkpoint is still there.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from dcp_zarr.errors import ZarrCheckpointError
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.frameworks, pytest.mark.distributed]

WAIT_S = 20  # how long a slowed deletion waits for the training to go on before it says it did not
AFTER_S = 0.3  # and then, before it deletes: a teardown that did not wait for it would return first


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- Lightning -------------------------------------------------------------------------------------------------------

_progress = {"step": 0, "ended": False}  # the training's, in a rank process (a Callback keeps it)
_removals: list[dict] = []  # what each slowed removal saw, in a rank process


def _slowed(remove):
    def slow_remove(aside: str) -> None:
        asked_at = _progress["step"]
        went_on = _wait_for(lambda: _progress["step"] > asked_at or _progress["ended"], WAIT_S)
        time.sleep(AFTER_S)
        remove(aside)
        _removals.append({"name": Path(aside).name, "asked_at": asked_at, "training_went_on": went_on,
                          "thread": threading.current_thread().name})

    return slow_remove


def _fit_with_slow_removals(rank: int, world_size: int, ckpt_dir: str) -> dict | None:
    """Rank program: Lightning's Trainer with the adapter's FSDP2 strategy, a checkpoint every 2 of 6 steps,
    ``ModelCheckpoint`` keeping the newest alone (it removes step 2's at step 4, step 4's at step 6); each removal
    slowed (module docstring). Rank 0: what the removals saw, and the checkpoint directory as ``fit`` left it."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    import dcp_zarr.integrations.lightning as adapter
    from tests.integrations.test_integration_lightning import TinyModule, dataset

    adapter._remove_set_aside = _slowed(adapter._remove_set_aside)  # this rank process's module only

    class Progress(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            _progress["step"] = trainer.global_step

        def on_train_end(self, trainer, pl_module) -> None:
            _progress["ended"] = True

    strategy = adapter.ZarrModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=6, default_root_dir=ckpt_dir,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=1, save_last=True), Progress()])
    trainer.fit(TinyModule(), torch.utils.data.DataLoader(dataset(), batch_size=4))
    if rank != 0:
        return None
    return {"removals": list(_removals), "left": sorted(os.listdir(ckpt_dir)),
            "main_thread": threading.current_thread().name}


@pytest.mark.slow
def test_lightning_saves_do_not_wait_for_model_checkpoints_removals_and_fit_ends_once_they_are_done(tmp_path):
    pytest.importorskip("lightning")
    ckpt_dir = tmp_path / "checkpoints"
    seen = run_ranks(_fit_with_slow_removals, 2, str(ckpt_dir), timeout=300)[0]
    # fit returned after the last removal (asked for at step 6, done after the training ended), staging dir and all
    assert seen["left"] == ["epoch=0-step=6.ckpt", "last.ckpt"], "fit returned before the removals were done"
    removals = seen["removals"]
    assert [r["name"].split(".deleting-")[0] for r in removals] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    for removal in removals:
        assert removal["training_went_on"], f"the training waited for the removal of {removal['name']}"
        assert removal["thread"] != seen["main_thread"]


def test_a_lightning_removal_is_renamed_aside_at_once_and_a_failed_one_is_raised_by_the_next(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    import dcp_zarr.integrations.lightning as adapter

    def failing_remove(aside: str) -> None:
        raise PermissionError(f"cannot remove {aside} (injected)")

    monkeypatch.setattr(adapter, "_remove_set_aside", failing_remove)
    strategy = adapter.ZarrModelParallelStrategy()  # rank 0 of no process group, as Lightning sees it unlaunched
    for name in ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.pt").write_bytes(b"lightning's")
    (tmp_path / "full.ckpt").write_bytes(b"a torch.save file")

    strategy.remove_checkpoint(tmp_path / "epoch=0-step=2.ckpt")
    assert not (tmp_path / "epoch=0-step=2.ckpt").exists(), "its name is free at once: renamed aside"
    for removals in strategy._zarr_removals.values():
        removals.join()
    with pytest.raises(ZarrCheckpointError, match=r"could not delete step 2 \(.dcp-zarr-staging/epoch=0-step=2\.ckpt"
                                                  r"\.deleting-[0-9a-f]+\): PermissionError: .*injected"):
        strategy.remove_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    assert (tmp_path / "epoch=0-step=4.ckpt").is_dir(), "the failure is raised before the next removal starts"
    strategy.remove_checkpoint(tmp_path / "full.ckpt")  # a file: Lightning's own removal, at once
    assert not (tmp_path / "full.ckpt").exists()
    (tmp_path / "best.ckpt").mkdir()  # a name that holds no step: named alone
    strategy.remove_checkpoint(tmp_path / "best.ckpt")
    for removals in strategy._zarr_removals.values():
        removals.join()
    with pytest.raises(ZarrCheckpointError, match=r"could not delete \.dcp-zarr-staging/best\.ckpt\.deleting-\w+: "):
        strategy.remove_checkpoint(tmp_path / "epoch=0-step=4.ckpt")


# -- torchtitan ------------------------------------------------------------------------------------------------------


class _State:
    """A Stateful in place of torchtitan's optimizers and schedulers: the purge is what is looked at here."""

    def __init__(self):
        self.value = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _titan_manager(base: str, keep_latest_k: int = 2, model: torch.nn.Module | None = None, incremental=False):
    """torchtitan's own manager with the adapter's overrides, made by its own ``__init__``; ``keep_latest_k=2`` is
    its least."""
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    config = ZarrCheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=keep_latest_k,
                                          zarr_incremental=incremental)
    return ZarrCheckpointManager(config, dataloader=None, model_parts=[model or torch.nn.Linear(4, 3)],
                                 optimizers=_State(), lr_schedulers=_State(), states={}, sd_adapter=None,
                                 base_folder=base)


def _torchtitan_purges_in_the_background(rank: int, world_size: int, base: str) -> dict:
    """Rank program: the manager saving steps 1 to 3; the deletion of step 1 slowed (module docstring), "the
    training going on" being ``save(3)`` having returned."""
    from dcp_zarr.lifecycle import deletion

    returned, purges = threading.Event(), []
    delete_step = deletion.delete_step

    def slow_delete_step(root, step: int, name: str | None = None) -> None:
        went_on = returned.wait(WAIT_S)
        time.sleep(AFTER_S)
        delete_step(root, step, name)
        purges.append({"name": name, "training_went_on": went_on, "thread": threading.current_thread().name})

    deletion.delete_step = slow_delete_step  # this rank process's module only
    renamed_aside = []
    rename = os.rename
    os.rename = lambda source, target: (renamed_aside.append(os.path.basename(source)), rename(source, target))[1]
    manager = _titan_manager(base)
    folder = os.path.join(base, "checkpoint")
    for step in (1, 2, 3):
        manager.save(step)  # at step 3, step 1 is stale: the purge deletes it
    left_when_saved = sorted(os.listdir(folder))
    returned.set()
    manager.close()
    return {"purges": purges, "left_when_saved": left_when_saved, "left_when_closed": sorted(os.listdir(folder)),
            "main_thread": threading.current_thread().name, "renamed_aside": renamed_aside}


def test_torchtitan_saves_do_not_wait_for_keep_latest_ks_purge_and_close_waits_for_it(tmp_path):
    pytest.importorskip("torchtitan")
    seen = run_ranks(_torchtitan_purges_in_the_background, 1, str(tmp_path), timeout=300)[0]
    assert seen["left_when_saved"] == ["step-1", "step-2", "step-3"], "save(3) returned before step 1 was deleted"
    [purge] = seen["purges"]
    assert purge["name"] == "step-1" and purge["training_went_on"] and purge["thread"] != seen["main_thread"]
    assert "step-1" in seen["renamed_aside"], "step-1 was not renamed aside before its removal (crash safety)"
    assert seen["left_when_closed"] == ["step-2", "step-3"], "close() returned once the purge was done"


def _torchtitan_deletion_fails(rank: int, world_size: int, base: str) -> dict:
    """Rank program: the deletion of step 1 fails, and the purge after ``save(4)`` raises it. Then, in a second
    manager, the deletion of step 4 fails and ``close()`` raises it."""
    from dcp_zarr.lifecycle import deletion

    delete_step, failing_steps = deletion.delete_step, {1}

    def failing(root, step: int, name: str | None = None) -> None:
        if step in failing_steps:
            raise PermissionError(f"injected for step {step}")
        delete_step(root, step, name)

    deletion.delete_step = failing
    raised, folder = {}, os.path.join(base, "checkpoint")
    manager = _titan_manager(base)
    for step in (1, 2, 3):
        manager.save(step)  # step 1's deletion fails in the background
    try:
        manager.save(4)
    except ZarrCheckpointError as exc:
        raised["save"] = str(exc)
    manager.close()  # raised once: nothing more
    left_after_save = sorted(os.listdir(folder))
    failing_steps = {4}
    manager = _titan_manager(base)
    for step in (5, 6):
        manager.save(step)  # save(5) deletes steps 1 to 3, save(6) step 4, which fails
    try:
        manager.close()
    except ZarrCheckpointError as exc:
        raised["close"] = str(exc)
    return {"raised": raised, "left_after_save": left_after_save, "left_after_close": sorted(os.listdir(folder))}


def test_a_failed_torchtitan_purge_is_raised_after_the_next_save_or_by_close(tmp_path):
    pytest.importorskip("torchtitan")
    seen = run_ranks(_torchtitan_deletion_fails, 1, str(tmp_path), timeout=300)[0]
    raised = seen["raised"]
    assert set(raised) == {"save", "close"}, raised
    assert "retention could not delete step 1 (step-1): PermissionError: injected for step 1" in raised["save"]
    assert "retention could not delete step 4 (step-4): PermissionError: injected for step 4" in raised["close"]
    # the purge that raised asked for nothing more; each failed step was left as it was
    assert seen["left_after_save"] == ["step-1", "step-2", "step-3", "step-4"]
    assert seen["left_after_close"] == ["step-4", "step-5", "step-6"]


def test_a_lightning_removal_a_killed_job_left_is_finished_before_the_next_jobs_first(tmp_path):
    pytest.importorskip("lightning")
    import dcp_zarr.integrations.lightning as adapter

    staging = tmp_path / ".dcp-zarr-staging"
    for name in ("epoch=0-step=2.ckpt.deleting-0123abcd", "best.ckpt.deleting-4567ef"):  # as a killed job left them
        (staging / name).mkdir(parents=True)
        (staging / name / "zarr.json").write_text("{}")
    (tmp_path / "epoch=0-step=4.ckpt").mkdir()
    strategy = adapter.ZarrModelParallelStrategy()
    strategy.remove_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    for removals in strategy._zarr_removals.values():
        removals.join()
    assert os.listdir(tmp_path) == [], "the removals a killed job left were not finished"


def _torchtitan_purges_on_an_object_store(rank: int, world_size: int, base: str, environment: dict) -> dict:
    """Rank program: the manager saving steps 1 to 3 incrementally into an S3 folder (a prefix written in place), step
    1 purged."""
    from dcp_zarr.lifecycle.root import CheckpointRoot

    os.environ.update(environment)  # torchtitan's fsspec and the adapter's storage alike
    manager = _titan_manager(base, incremental=True)
    for step in (1, 2, 3):
        manager.save(step)
    manager.close()
    root = CheckpointRoot(f"{base}/checkpoint")
    chunks = root.open("step-3").read_json("zarr.json")["attributes"]["dcp_zarr"]["chunks"]
    return {"stores": [(s.name, s.complete) for s in root.step_stores()], "records": root.records(),
            "step 3 from": chunks.get("incremental_from")}


@pytest.mark.s3
def test_a_torchtitan_purge_on_an_object_store_deletes_the_stale_step_and_saves_reuse_the_one_before(s3):
    pytest.importorskip("torchtitan")
    from dcp_zarr.testing.s3_server import AWS_ENVIRONMENT

    environment = dict(AWS_ENVIRONMENT, AWS_ENDPOINT_URL=s3.endpoint, AWS_ALLOW_HTTP="true")
    seen = run_ranks(_torchtitan_purges_on_an_object_store, 1, f"s3://{s3.bucket}/titan-purge", environment,
                     timeout=300)[0]
    assert seen["stores"] == [("step-2", True), ("step-3", True)], seen
    assert seen["records"] == [], "the deleting record outlived the deletion"
    assert seen["step 3 from"] and seen["step 3 from"]["reused_chunks"] > 0, "step 3 was saved in full"
