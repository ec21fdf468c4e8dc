"""``ZarrCheckpointManager`` (dcp_zarr.integrations.torchtitan) under torchtitan's own Trainer: its debug llama3,
smaller, on CPU gloo ranks (the patches that needs: tests/support/torchtitan_cpu.py), trained through its own
``train()`` with the manager chosen by its config; then resumed at 1, 2 and 3 ranks.

Saved at 2 ranks (``trained``, one launch), a checkpoint after every step, the last (step 4) saved synchronously
as torchtitan always does: ``sync/`` (``keep_latest_k=2``, ``zarr_incremental=True``: its purge deletes step 1, the
base of step 2), ``async/`` (steps 1-3 threaded, full saves: the default), ``pinned/`` (steps 1-3 through DCP's
process executor and torchtitan's stager, every step compressed and incremental: ``zarr_compression="zstd"`` and
``zarr_incremental=True``, so the writer the background process is given carries both), ``resumed/`` (a copy of
``sync/`` resumed at step 2 and trained to step 4 again, saving steps 3 and 4 again, incrementally) and ``hf/``
(the model exported through torchtitan's own HF path). Every run sees the same data and learning-rate schedule, so
a step's state is the same whatever the mode: what one store holds can be checked against another's. The token
embeddings are frozen (a parameter group of torchtitan's optimizer config with lr 0, no weight decay): unchanged
from step to step, so that an incremental save has chunks to link.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zarr

from dcp_zarr import open_checkpoint
from dcp_zarr.errors import FrameworkNotInstalledError, FrameworkVersionError
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.writer import ZarrWriter
from tests.support.compare import assert_state_equal
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.frameworks, pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("torchtitan")

STEPS = 4
ADAPTER = "dcp_zarr.integrations.torchtitan"
# (dump folder, async_mode, checkpoint interval, keep_latest_k, zarr_compression, zarr_incremental): the saving runs
# of ``trained``.
RUNS = [("sync", "disabled", 1, 2, None, True), ("async", "async", 1, 0, None, False),
        ("pinned", "async_with_pinned_mem", 1, 0, "zstd", True)]
FROZEN = "tok_embeddings.weight"  # 2 MiB: 2 chunks of 1 MiB in an incremental save
# What the resumes load from each run: the latest step (-1: found by _find_load_step, step 4) or an asynchronously
# saved one; and the step each must then be at.
RESUMES = [("sync", -1), ("async", 3), ("pinned", 3)]
RESUMED_STEP = {"sync": STEPS, "async": 3, "pinned": 3}


# -- in the ranks ----------------------------------------------------------------------------------------------------


def _trainer(dump: str, steps: int = STEPS, **checkpoint):
    """torchtitan's Trainer over the tiny llama3, its checkpoint manager chosen by one config line."""
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager
    from tests.support.torchtitan_cpu import tiny_llama3_config

    config = tiny_llama3_config(dump, ZarrCheckpointManager.Config(enable=True, last_save_model_only=False,
                                                                   **checkpoint), steps=steps)
    trained = config.optimizer.param_groups[-1]  # the catch-all AdamW group
    config.optimizer.param_groups.insert(0, type(trained)(
        pattern=rf"^{FROZEN}$", optimizer_name=trained.optimizer_name,
        optimizer_kwargs={**trained.optimizer_kwargs, "lr": 0.0, "weight_decay": 0.0}))
    trainer = config.build()
    losses = {}
    log = trainer.metrics_processor.log

    def record_loss(step, loss, *args, **kwargs):
        losses[step] = loss
        return log(step, loss, *args, **kwargs)

    trainer.metrics_processor.log = record_loss
    return trainer, losses


def _train_every_mode(rank: int, world_size: int, root: str) -> dict:
    from tests.support.torchtitan_cpu import use_cpu

    use_cpu()
    from torch.distributed.checkpoint import _async_process_executor
    from torchtitan.components.checkpointer import AsyncMode

    losses = {}
    for name, async_mode, interval, keep, compression, incremental in RUNS:
        trainer, losses[name] = _trainer(f"{root}/{name}", async_mode=async_mode, interval=interval,
                                         keep_latest_k=keep, zarr_compression=compression,
                                         zarr_incremental=incremental)
        trainer.train()
        if name == "sync":  # the HF export, through torchtitan's own writer
            trainer.checkpointer.dcp_save(trainer.checkpointer.states["model"].state_dict(), f"{root}/hf",
                                          AsyncMode.DISABLED, to_hf=True)
        trainer.close()
    process_executor_used = _async_process_executor._CHECKPOINT_PROCESS is not None

    # A restart from step 2 of a run that went on to step 4: trains steps 3 and 4 again and saves them again.
    if rank == 0:
        shutil.copytree(f"{root}/sync", f"{root}/resumed")
    dist.barrier()
    before = {step: _root_document_inode(root, step) for step in (2, 3, 4)}
    trainer, losses["resumed"] = _trainer(f"{root}/resumed", interval=1, keep_latest_k=0, load_step=2,
                                          zarr_incremental=True)
    trainer.train()
    trainer.close()
    resaved = [step for step in (2, 3, 4) if _root_document_inode(root, step) != before[step]]
    return {"losses": losses, "process_executor_used": process_executor_used, "resaved": resaved}


def _root_document_inode(root: str, step: int) -> int:
    return os.stat(f"{root}/resumed/checkpoint/step-{step}/zarr.json").st_ino


def _full(value):
    """DTensors gathered whole (a collective: every rank walks the same dicts in the same order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {key: _full(item) for key, item in value.items()}
    return value


def _resume(rank: int, world_size: int, root: str) -> dict:
    from tests.support.torchtitan_cpu import use_cpu

    use_cpu()
    outcomes = {}
    for name, load_step in RESUMES:
        trainer, _ = _trainer(f"{root}/{name}", load_step=load_step)
        trainer.checkpointer.load(step=load_step)  # what train() does first
        states = trainer.checkpointer.states
        # The model as its parameters are now (the wrapper's state_dict is computed from them), not the dict DCP
        # loaded into: the fused wqkv is split by a state_dict hook, so only the wrapper's load reaches it.
        loaded = {key: value.state_dict() for key, value in states.items() if key != "model"}
        loaded.update(states["model"].state_dict())
        loaded = _full(loaded)
        store = open_checkpoint(f"{root}/{name}/checkpoint/step-{trainer.step}").load_full_state_dict()
        try:
            assert_state_equal(loaded, store)
            difference = None
        except AssertionError as exc:
            difference = str(exc)
        outcomes[name] = (trainer.step, difference)
        trainer.close()
    return outcomes


# -- fixtures --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("torchtitan")
    results = run_ranks(_train_every_mode, 2, str(root), timeout=420)
    assert results[0]["losses"] == results[1]["losses"]  # each a global average
    return root, results[0]


@pytest.fixture(scope="module", params=[1, 3], ids=["1-rank", "3-ranks"])
def resumed(request, trained) -> dict:
    root, _ = trained
    return run_ranks(_resume, request.param, str(root), timeout=420)


def store_state(root, run: str, step: int) -> dict:
    return open_checkpoint(root / run / "checkpoint" / f"step-{step}").load_full_state_dict()


def step_folders(root, run: str) -> list[str]:
    return sorted(os.listdir(root / run / "checkpoint"))


# -- saving ----------------------------------------------------------------------------------------------------------


def test_every_step_folder_is_a_committed_zarr_store_not_a_dcp_directory(trained):
    root, _ = trained
    for run, steps in [("sync", [2, 3, 4]), ("async", [1, 2, 3, 4]), ("pinned", [1, 2, 3, 4])]:
        assert step_folders(root, run) == [f"step-{s}" for s in steps]
        checkpoints = CheckpointRoot(root / run / "checkpoint")
        for step in steps:
            store = root / run / "checkpoint" / f"step-{step}"
            assert checkpoints.is_complete(f"step-{step}")
            assert not (store / ".metadata").exists()
            assert open_checkpoint(store).saved_world_size == 2
        lm_head = zarr.open_group(store, mode="r")["lm_head.weight"][:]  # any zarr reader, without dcp_zarr
        assert torch.equal(torch.from_numpy(lm_head), store_state(root, run, steps[-1])["lm_head.weight"])


def test_zarr_python_alone_reads_the_trainers_values_and_inspect_fits_a_screen(trained):
    root, _ = trained
    store = root / "sync" / "checkpoint" / "step-3"
    group = zarr.open_group(store, mode="r")  # torchtitan's Stateful values: attributes of their groups
    saved = open_checkpoint(store)
    assert group["train_state"].attrs["step"] == 3 and type(group["train_state"].attrs["step"]) is int
    assert dict(group["train_state"].attrs) == {"step": 3,
                                                "ntokens_seen": saved.read_value("train_state.ntokens_seen")}
    assert group["lr_scheduler"].attrs["last_epoch"] == saved.read_value("lr_scheduler.last_epoch") == 3
    assert group["dataloader"].attrs["consumed"] == saved.read_value("dataloader.consumed")

    done = subprocess.run([sys.executable, "-m", "dcp_zarr", "inspect", str(store)], capture_output=True, text=True,
                          timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) <= 60, done.stdout + done.stderr
    assert "  train_state.step = 3" in lines


def test_the_steps_differ_so_loading_the_wrong_one_would_show(trained):
    root, _ = trained
    with pytest.raises(AssertionError):
        assert_state_equal(store_state(root, "sync", 2), store_state(root, "sync", 4))


def test_async_and_pinned_memory_saves_hold_what_the_synchronous_run_saved(trained):
    root, result = trained
    assert result["process_executor_used"]  # the pinned mode's saves ran in DCP's background process
    for run in ("async", "pinned"):
        for step in (2, 3):
            assert_state_equal(store_state(root, run, step), store_state(root, "sync", step))
        assert [result["losses"][run][s] for s in range(1, STEPS + 1)] == \
            [result["losses"]["sync"][s] for s in range(1, STEPS + 1)]


def test_zarr_compression_compresses_the_float_arrays_of_every_step_and_only_those(trained):
    # Exactness: test_async_and_pinned_memory_saves_hold_what_the_synchronous_run_saved compares these stores with
    # the uncompressed sync run's, and the resumes at 1 and 3 ranks load pinned's step 3 (RESUMES).
    root, _ = trained
    for step in range(1, STEPS + 1):  # steps 1-3 written in DCP's background process, step 4 in the ranks
        entries = open_checkpoint(root / "pinned" / "checkpoint" / f"step-{step}").entries
        # The float32 arrays of 64 KiB or more (Compression's min_bytes): the weights and their AdamW moments, not
        # the norms (1 KiB), the step counters or the values
        large = {fqn for fqn, entry in entries.items() if entry.dtype_name == "torch.float32"
                 and entry.nbytes >= 64 << 10}
        assert {"tok_embeddings.weight", "layers.0.feed_forward.w1.weight", "lm_head.weight",
                "optimizer.state.lm_head.weight.exp_avg_sq"} <= large
        assert {fqn for fqn, entry in entries.items() if entry.codec is not None} == large, step
        assert {entry.codec["configuration"]["cname"] for entry in entries.values() if entry.codec} == {"zstd"}
    for run in ("sync", "async"):  # zarr_compression=None, the default
        entries = open_checkpoint(root / run / "checkpoint" / "step-3").entries
        assert all(entry.codec is None for entry in entries.values())
    # As any zarr tool sees it: the blosc codec in the array's own zarr.json
    array = zarr.open_group(root / "pinned" / "checkpoint" / "step-3", mode="r")["lm_head.weight"]
    assert '"blosc"' in json.dumps(array.metadata.to_dict()["codecs"])


def test_keep_latest_k_still_purges(trained):
    root, _ = trained
    # torchtitan purges after each save but the last step's: step 1 went when step 3 was saved
    assert step_folders(root, "sync") == ["step-2", "step-3", "step-4"]


def test_hf_export_is_torchtitans_safetensors(trained):
    from safetensors.torch import load_file

    root, _ = trained
    assert (root / "hf" / "model.safetensors.index.json").is_file()
    assert not (root / "hf" / "zarr.json").exists()
    exported = load_file(root / "hf" / "model-00001-of-00001.safetensors")
    saved = store_state(root, "sync", STEPS)  # the model the export was made of, after the last step
    assert torch.equal(exported["lm_head.weight"], saved["lm_head.weight"])
    assert torch.equal(exported["model.norm.weight"], saved["norm.weight"])


# -- incremental saves (zarr_incremental) ---------------------------------------------------------------------------


def store_of(root, run: str, step: int):
    return root / run / "checkpoint" / f"step-{step}"


def chunk_files(store, fqn: str) -> list:
    """The files of the array saved as ``fqn`` in ``store``, its zarr.json aside: its chunks (or shards)."""
    node = store / open_checkpoint(store).entries[fqn].node
    return sorted(path for path in node.rglob("*") if path.is_file() and path.name != "zarr.json")


def chunk_record(store) -> dict | None:
    """The manifest's ``chunks`` (as any JSON reader sees the root zarr.json), None for a save that records none."""
    return json.loads((store / "zarr.json").read_text())["attributes"]["dcp_zarr"].get("chunks")


def test_zarr_incremental_links_the_unchanged_chunks_of_the_step_before_and_writes_the_rest(trained):
    root, _ = trained
    for run, steps in [("sync", [2, 3, 4]), ("pinned", [2, 3, 4])]:  # pinned's in DCP's background process
        for step in steps:
            store = store_of(root, run, step)
            origin = chunk_record(store)["incremental_from"]
            assert origin["path"] == str(store_of(root, run, step - 1)), (run, step)
            assert origin["reused_chunks"] >= len(chunk_files(store, FROZEN)) == 2, (run, step)
            assert all(os.stat(path).st_nlink > 1 for path in chunk_files(store, FROZEN)), (run, step)
            assert all(os.stat(path).st_nlink == 1 for path in chunk_files(store, "lm_head.weight")), (run, step)
    first = chunk_record(store_of(root, "pinned", 1))  # the first save: in full, recording its chunks
    assert FROZEN in {entry.fqn for entry in open_checkpoint(store_of(root, "pinned", 1)).entries.values()}
    assert first is not None and "incremental_from" not in first


def test_without_zarr_incremental_nothing_is_recorded_or_linked(trained):
    root, _ = trained
    for step in (2, 3, 4):
        store = store_of(root, "async", step)
        assert chunk_record(store) is None
        assert all(path.stat().st_nlink == 1 for path in store.rglob("*") if path.is_file())


def test_keep_latest_k_deleting_a_base_leaves_the_step_that_linked_it_whole(trained):
    root, _ = trained
    # step 1, the base of step 2, was purged when step 3 was saved; step 2 is what the full save of async/ holds.
    # (The resumes load sync's step 4 and pinned's step 3, incremental both, and the restart loads sync's step 2.)
    assert not store_of(root, "sync", 1).exists()
    assert chunk_record(store_of(root, "sync", 2))["incremental_from"]["path"] == str(store_of(root, "sync", 1))
    assert_state_equal(store_state(root, "sync", 2), store_state(root, "async", 2))


def test_a_restart_saving_a_step_again_reuses_the_newest_other_complete_step(trained):
    root, _ = trained
    # resumed/ held steps 2-4 when step 3 was saved again: its base was step 4, then step 4's the new step 3
    assert chunk_record(store_of(root, "resumed", 3))["incremental_from"]["path"] == \
        str(store_of(root, "resumed", 4))
    assert chunk_record(store_of(root, "resumed", 4))["incremental_from"]["path"] == \
        str(store_of(root, "resumed", 3))
    assert all(os.stat(path).st_nlink > 1 for path in chunk_files(store_of(root, "resumed", 4), FROZEN))


# -- resuming --------------------------------------------------------------------------------------------------------


def test_resume_at_two_ranks_continues_as_the_uninterrupted_run(trained):
    root, result = trained
    losses = result["losses"]
    assert sorted(losses["resumed"]) == [3, 4]  # started at step 3: it loaded step 2
    assert [losses["resumed"][s] for s in (3, 4)] == [losses["sync"][s] for s in (3, 4)]
    assert_state_equal(store_state(root, "resumed", 4), store_state(root, "sync", 4))


def test_a_restart_saves_an_existing_step_again(trained):
    root, result = trained
    assert result["resaved"] == [3, 4]
    assert step_folders(root, "resumed") == ["step-2", "step-3", "step-4"]
    assert not (root / "resumed" / "checkpoint" / ".dcp-zarr-staging").exists()


@pytest.mark.parametrize("run", [name for name, _ in RESUMES])
def test_resume_at_another_world_size_loads_every_tensor_exactly(resumed, run):
    for rank_outcomes in resumed:
        step, difference = rank_outcomes[run]
        assert step == RESUMED_STEP[run]
        assert difference is None, difference


# -- what the adapter adds to torchtitan, in this process ------------------------------------------------------------


def _manager(cls, folder):
    manager = cls.__new__(cls)  # the overridden methods need only these of what __init__ sets
    manager.folder, manager.states = str(folder), {}
    return manager


def test_without_the_adapter_a_resume_would_start_afresh(trained):
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    root, _ = trained
    folder = root / "sync" / "checkpoint"
    assert _manager(CheckpointManager, folder)._find_load_step() == -1
    assert _manager(ZarrCheckpointManager, folder)._find_load_step() == 4


def test_find_load_step_counts_committed_stores_named_exactly_and_torchtitans_own(trained, tmp_path):
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    root, _ = trained
    complete = root / "sync" / "checkpoint" / "step-2"
    shutil.copytree(complete, tmp_path / "step-3")
    shutil.copytree(complete, tmp_path / "step-9.old")  # a copy put aside: not a step folder
    (tmp_path / "step-8").mkdir()  # a folder without a committed store
    shutil.copytree(complete, tmp_path / "step-7")
    (tmp_path / "step-7" / "zarr.json").unlink()
    manager = _manager(ZarrCheckpointManager, tmp_path)
    assert manager._find_load_step() == 3
    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / ".metadata").write_bytes(b"")  # DCP's own, as torchtitan finds it
    assert manager._find_load_step() == 5


def _saved(path, incremental: bool = True) -> None:
    dcp.save({"w": torch.ones(4)}, storage_writer=ZarrWriter(path, incremental=incremental), no_dist=True)


def _incremental_manager(folder, keep_latest_k: int = 0):
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    manager = _manager(ZarrCheckpointManager, folder)
    manager._zarr_incremental, manager.keep_latest_k = True, keep_latest_k
    return manager


def _base(manager, step: int, async_mode: str = "disabled") -> str | None:
    from torchtitan.components.checkpointer import AsyncMode

    return manager._incremental_base(f"{manager.folder}/step-{step}", AsyncMode(async_mode))


def test_an_incremental_save_reuses_the_newest_complete_step_folder_but_its_own(tmp_path):
    for name in ("step-1", "step-3", "step-5", "step-9.old"):
        _saved(tmp_path / name)
    (tmp_path / "step-5" / "zarr.json").unlink()  # a save that never committed
    manager = _incremental_manager(tmp_path)
    assert _base(manager, 4) == str(tmp_path / "step-3")
    assert _base(manager, 3) == str(tmp_path / "step-1")
    assert _base(_incremental_manager(tmp_path / "empty"), 1) is None  # the first save: in full


def test_a_step_an_async_save_may_still_be_writing_is_never_a_base(tmp_path):
    from concurrent.futures import Future

    for name in ("step-1", "step-2"):
        _saved(tmp_path / name)
    manager = _incremental_manager(tmp_path)
    writing = Future()
    manager._zarr_in_flight = (str(tmp_path / "step-2"), writing)  # as dcp_save leaves an async save
    assert _base(manager, 3, "async") == str(tmp_path / "step-1")
    writing.set_result(None)
    assert _base(manager, 3, "async") == str(tmp_path / "step-2")


def test_a_step_keep_latest_k_purges_is_never_a_base(tmp_path):
    _saved(tmp_path / "step-1")
    (tmp_path / "step-2").mkdir()  # an HF export: a step folder to torchtitan's purge, not a store
    (tmp_path / "step-2" / "model.safetensors.index.json").write_text("{}")
    # keep_latest_k=1: the purge keeps step-2 alone, so step-1 is deleted, maybe while this save reads it
    assert _base(_incremental_manager(tmp_path, keep_latest_k=1), 3) is None
    assert _base(_incremental_manager(tmp_path, keep_latest_k=2), 3) == str(tmp_path / "step-1")


@pytest.mark.s3
def test_on_storage_written_in_place_an_async_save_counts_itself_among_what_keep_latest_k_keeps(
        s3, aws_environment, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)  # torchtitan's fsspec and the adapter's storage alike
    folder = f"s3://{s3.bucket}/in-place/checkpoint"
    _saved(f"{folder}/step-1")
    manager = _incremental_manager(folder, keep_latest_k=1)
    assert _base(manager, 2) == f"{folder}/step-1"  # synchronous: the purge runs once step-2 is complete
    # async: step-2's objects appear as they are written, and the purge that runs meanwhile keeps step-2 alone
    assert _base(manager, 2, "async") is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_directory_still_loads_through_torchtitans_reader(tmp_path):
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    saved = {"w": torch.arange(6.0).reshape(2, 3)}
    dcp.save(saved, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    target = {"w": torch.zeros(2, 3)}
    _manager(ZarrCheckpointManager, tmp_path).dcp_load(target, str(tmp_path / "step-1"), False, False)
    assert torch.equal(target["w"], saved["w"])


def test_hf_saves_and_loads_go_to_torchtitans_own_code(monkeypatch):
    from torchtitan.components.checkpointer import AsyncMode, CheckpointManager

    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    calls = []
    monkeypatch.setattr(CheckpointManager, "dcp_save", lambda self, *args, **kwargs: calls.append(("save", args)))
    monkeypatch.setattr(CheckpointManager, "dcp_load", lambda self, *args, **kwargs: calls.append(("load", args)))
    manager = _manager(ZarrCheckpointManager, "unused")
    manager.dcp_save({}, "hf-out", AsyncMode.DISABLED, False, True)
    manager.dcp_load({}, "hf-in", True, False)
    assert calls == [("save", ({}, "hf-out", AsyncMode.DISABLED, False, True)), ("load", ({}, "hf-in", True, False))]


# -- when torchtitan is missing or changed ---------------------------------------------------------------------------


def _import_adapter(monkeypatch):
    monkeypatch.delitem(sys.modules, ADAPTER, raising=False)
    return importlib.import_module(ADAPTER)


def test_without_torchtitan_importing_the_adapter_says_what_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: every import of it fails
    monkeypatch.setitem(sys.modules, "torchtitan", None)
    with pytest.raises(FrameworkNotInstalledError, match=r"pip install 'torchtitan==0\.3\.0'"):
        _import_adapter(monkeypatch)


@pytest.mark.parametrize("change", ["method removed", "signature changed", "module moved"])
def test_changed_torchtitan_internals_name_both_versions(monkeypatch, change):
    from torchtitan.components.checkpointer import CheckpointManager

    if change == "method removed":
        monkeypatch.delattr(CheckpointManager, "_find_load_step")
        missing = r"CheckpointManager\._find_load_step"
    elif change == "signature changed":
        monkeypatch.setattr(CheckpointManager, "dcp_load", lambda self, state_dict, checkpoint_id, options: None)
        missing = r"CheckpointManager\.dcp_load\(state_dict, checkpoint_id, from_hf, from_quantized\)"
    else:
        monkeypatch.setitem(sys.modules, "torchtitan.components.checkpointer.dcp", None)
        missing = r"module torchtitan\.components\.checkpointer\.dcp"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.4.0" if name == "torchtitan" else "?")
    with pytest.raises(FrameworkVersionError, match=r"written against torchtitan 0\.3\.0") as raised:
        _import_adapter(monkeypatch)
    assert "torchtitan 0.4.0 does not have" in str(raised.value)
    assert raised.match(missing)


@pytest.mark.parametrize(("value", "error", "said"), [("zst", ValueError, "names no compressor"),
                                                      (3, TypeError, "is not a compression choice")])
def test_a_bad_zarr_compression_is_refused_as_the_config_is_built_and_as_the_manager_is(value, error, said):
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    message = (rf"ZarrCheckpointManager: checkpoint\.zarr_compression={value!r} {said}: set it to one of the "
               r"compressors \('zstd', 'lz4', 'lz4hc', 'blosclz', 'zlib'\) or to None")
    with pytest.raises(error, match=message):  # as tyro builds it from the command line or a TOML file
        ZarrCheckpointManager.Config(enable=True, zarr_compression=value)
    config = ZarrCheckpointManager.Config(enable=True)
    config.zarr_compression = value  # set afterwards: the manager checks it again, before torchtitan's __init__
    with pytest.raises(error, match=message):
        ZarrCheckpointManager(config)


@pytest.mark.parametrize("value", ["yes", None, 2])
def test_a_bad_zarr_incremental_is_refused_as_the_config_is_built_and_as_the_manager_is(value):
    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    message = rf"ZarrCheckpointManager: checkpoint\.zarr_incremental={value!r} is not a choice: pass True"
    with pytest.raises(TypeError, match=message):
        ZarrCheckpointManager.Config(enable=True, zarr_incremental=value)
    config = ZarrCheckpointManager.Config(enable=True)
    config.zarr_incremental = value
    with pytest.raises(TypeError, match=message):
        ZarrCheckpointManager(config)


def test_a_manager_missing_what_init_sets_is_refused_naming_the_versions(monkeypatch):
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    def init_without_a_group_for_async_saves(self, config, **components):
        self.enable, self.folder, self.states, self.stager = True, "unused", {}, None

    monkeypatch.setattr(CheckpointManager, "__init__", init_without_a_group_for_async_saves)
    with pytest.raises(FrameworkVersionError, match=r"torchtitan 0\.3\.0.*CheckpointManager instance\.pg"):
        ZarrCheckpointManager(ZarrCheckpointManager.Config(enable=True))
