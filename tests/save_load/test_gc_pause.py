"""The cyclic collector paused during a save's and load's own steps on the main thread, and only then."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_zarr.loading.rank_reads
import dcp_zarr.saving.coordinator
import dcp_zarr.store_io.write_jobs
from dcp_zarr import ZarrReader, ZarrWriter
from dcp_zarr.gc_pause import collector_paused, step_with_collector_paused
from dcp_zarr.loading.rank_reads import RankReads
from dcp_zarr.store_io.write_jobs import WriteJobs


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def _state_inside() -> bool:
    return gc.isenabled()


def test_paused_inside_and_restored_after(collector_on):
    assert step_with_collector_paused(_state_inside)() is False
    assert gc.isenabled()


def test_restored_after_an_exception(collector_on):
    @step_with_collector_paused
    def fails():
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails()
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_caller_stays_off(collector_on):
    gc.disable()
    assert step_with_collector_paused(_state_inside)() is False
    assert not gc.isenabled()


def test_nested_steps_restore_once(collector_on):
    inner = step_with_collector_paused(_state_inside)
    outer = step_with_collector_paused(lambda: (inner(), gc.isenabled()))
    assert outer() == (False, False)
    assert gc.isenabled()


def test_a_background_thread_leaves_the_collector_on(collector_on):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(step_with_collector_paused(_state_inside)()))
    thread.start()
    thread.join()
    assert seen == [True]
    assert gc.isenabled()


def test_overlapping_pauses_on_two_threads_end_with_the_last(collector_on):
    """A thread's decode that began during a step does not find the collector off and leave it so."""
    entered, leave = threading.Event(), threading.Event()

    def other_thread():
        with collector_paused():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other_thread)
    with collector_paused():
        thread.start()
        assert entered.wait(10)
    assert not gc.isenabled()  # the other thread's pause is still under way
    leave.set()
    thread.join()
    assert gc.isenabled()


def test_a_child_forked_during_a_pause_has_its_collector_back(collector_on):
    with collector_paused():
        pid = os.fork()
        if pid == 0:  # the child: no thread of its own will end the parent's pause
            os._exit(0 if gc.isenabled() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()


def _record_transfers(monkeypatch) -> list[tuple[str, bool]]:
    seen: list[tuple[str, bool]] = []
    for cls, method in ((WriteJobs, "run"), (RankReads, "read_directly")):
        real = getattr(cls, method)

        def recording(self, *args, _real=real, _name=method, **kwargs):
            seen.append((_name, gc.isenabled()))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, recording)
    return seen


def test_transfers_pause_the_collector_for_a_local_path_only(tmp_path, monkeypatch, collector_on):
    """An object store's client keeps its collections for the minutes a transfer may take (gc_pause.py)."""
    from zarr.storage import MemoryStore

    seen = _record_transfers(monkeypatch)
    state = {"w": torch.rand(4, 3)}
    dcp.save(state, storage_writer=ZarrWriter(tmp_path / "local"))
    dcp.load({"w": torch.zeros(4, 3)}, storage_reader=ZarrReader(tmp_path / "local"))
    assert seen == [("run", False), ("read_directly", False)]
    seen.clear()
    store = MemoryStore()
    dcp.save(state, storage_writer=ZarrWriter(store=store))
    loaded = {"w": torch.zeros(4, 3)}
    dcp.load(loaded, storage_reader=ZarrReader(store=store))
    assert seen == [("run", True), ("read_directly", True)]
    assert torch.equal(loaded["w"], state["w"])


def test_save_and_load_write_and_read_with_the_collector_paused(tmp_path, monkeypatch, collector_on):
    """The decorators sit where the entries' work is done: every batch of jobs of the writer and reader runs paused."""
    seen: list[tuple[str, bool]] = []
    for module, runner in ((dcp_zarr.store_io.write_jobs, "run_jobs"), (dcp_zarr.saving.coordinator, "run_jobs"),
                           (dcp_zarr.loading.rank_reads, "run_storage_jobs")):
        real = getattr(module, runner)

        def recording(*args, _real=real, _name=module.__name__, **kwargs):
            seen.append((_name, gc.isenabled()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, runner, recording)
    state = {f"layer{i}.weight": torch.rand(3, 5) for i in range(20)}
    dcp.save(state, storage_writer=ZarrWriter(tmp_path / "ck"))
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=ZarrReader(tmp_path / "ck"))
    assert {name for name, _ in seen} == {"dcp_zarr.store_io.write_jobs", "dcp_zarr.saving.coordinator",
                                          "dcp_zarr.loading.rank_reads"}
    assert [on for _, on in seen if on] == []
    assert gc.isenabled()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
