"""What dcp_zarr reads or sets inside torch.distributed.checkpoint, held in one module (planning/dcp_internals.py):
nothing else reaches into DCP's frames, no module global of torch is written, a torch that keeps a call's state
elsewhere is said once a process (and the save or load still comes out right), and one planner given to two calls at
once, in two threads, is refused by name while the call already running comes out right."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _nested_dict, _version, default_planner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter, open_checkpoint, torch_private
from dcp_zarr.errors import SharedPlannerError, UnverifiedTorchWarning
from dcp_zarr.planning import dcp_internals
from dcp_zarr.testing.planners import DCPsPlanning
from dcp_zarr.torch_private import torch_2_3_keys
from tests.support.compare import assert_state_equal
from tests.support.faults import causes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PACKAGE = Path(dcp_internals.__file__).resolve().parent.parent
TAKEN_OVER = {"create_local_plan", "create_global_plan", "finish_plan"}
WAIT_S = 60  # for a thread to reach the point a test holds it at: never reached unless something hangs


@pytest.fixture(autouse=True)
def not_warned_yet(monkeypatch):
    monkeypatch.setattr(dcp_internals, "_warned", set())


def test_one_module_reaches_into_dcps_frames_and_one_reads_its_version_switch():
    def reading(name: str) -> list[str]:
        return sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if name in path.read_text())

    assert reading("_getframe") == ["planning/dcp_internals.py"]
    assert reading("_derived_version") == ["torch_private.py"]


# -- torch 2.3's key form, asked without touching torch's switch ----------------------------------------------------


STATE_DICTS = [
    {"w": torch.zeros(1), "meta": {"milestones": [10, 20]}},
    {"model": {"a": torch.ones(2), "b": {"c": torch.ones(1)}}, "optim": {"state": {0: {"step": torch.tensor(1.0)}},
                                                                        "param_groups": [{"lr": 0.1, "params": [0]}]}},
    {"list": [torch.ones(1), {"x": 3}], "plain": 4, "empty": {}, "nested": {"deeper": {"values": [1, 2]}}},
]


@pytest.mark.parametrize("state_dict", STATE_DICTS, ids=["values", "optimizer", "lists"])
def test_torch_2_3_keys_are_dcps_flattening_with_its_switch_on(state_dict, monkeypatch):
    ours = torch_2_3_keys(state_dict)
    monkeypatch.setattr(_version, "_derived_version", "2_3")  # the test asks DCP the old way, for comparison
    dcps, _ = _nested_dict.flatten_state_dict(state_dict)
    assert ours == set(dcps)


def test_torch_2_3_keys_are_asked_without_writing_torchs_switch(monkeypatch):
    class Unwritable:
        _derived_version = None

        def __setattr__(self, name, value):
            raise AssertionError(f"torch's module global {name} written")

    monkeypatch.setattr(torch_private, "_version", Unwritable())
    assert dcp_internals._may_be_of_torch_2_3(STATE_DICTS[0], {"meta"})
    assert not dcp_internals._may_be_of_torch_2_3(STATE_DICTS[0], {"optim.state.w.step"})


def test_where_torch_cannot_say_torch_2_3_keys_dcp_decides(monkeypatch):
    collide = {"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)}
    assert torch_2_3_keys(collide) is None, "keys that collide: DCP's error"
    monkeypatch.delattr(_nested_dict, "traverse_state_dict_v_2_3")
    assert dcp_internals._may_be_of_torch_2_3(STATE_DICTS[0], {"optim.state.w.step"})
    monkeypatch.undo()
    monkeypatch.delattr(_version, "_derived_version")
    assert dcp_internals._may_be_of_torch_2_3(STATE_DICTS[0], {"optim.state.w.step"})


# -- another torch: the slower protocol, said once a process --------------------------------------------------------


def _moved(monkeypatch, call: str) -> None:
    """As if torch kept a call's planner and distW in a function of another name."""
    monkeypatch.setattr(dcp_internals, call, getattr(dcp_internals, call)._replace(step="moved_local_step"))


def _unverified(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UnverifiedTorchWarning)]


def test_a_save_where_torch_moved_its_frames_follows_dcps_planning_and_says_so_once(tmp_path, monkeypatch):
    _moved(monkeypatch, "_SAVE")
    state = {"w": torch.arange(6.0), "step": 3}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = dcp.save(state, storage_writer=ZarrWriter(str(tmp_path / "a.zarr")))
        dcp.save(state, storage_writer=ZarrWriter(str(tmp_path / "b.zarr")))
    said = _unverified(caught)
    assert len(said) == 1, said
    assert f"torch {torch.__version__}" in said[0] and "2.13, 2.14, 2.15" in said[0] and "dcp.save" in said[0]
    assert set(first.state_dict_metadata) == {"w", "step"}, "DCP planned it: its metadata lists every entry"
    assert_state_equal(open_checkpoint(str(tmp_path / "a.zarr")).load_full_state_dict(), state)


def test_a_load_where_torch_moved_its_frames_is_planned_by_dcp_and_says_so_once(tmp_path, monkeypatch):
    path = str(tmp_path / "s.zarr")
    dcp.save({"w": torch.arange(4.0)}, storage_writer=ZarrWriter(path))
    _moved(monkeypatch, "_LOAD")
    calls: list = []
    own = default_planner.create_default_local_load_plan
    monkeypatch.setattr(default_planner, "create_default_local_load_plan",
                        lambda *args, **kwargs: calls.append(1) or own(*args, **kwargs))
    targets = [{"w": torch.zeros(4)}, {"w": torch.zeros(4)}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for target in targets:
            dcp.load(target, storage_reader=ZarrReader(path))
    said = _unverified(caught)
    assert len(said) == 1 and "dcp.load" in said[0] and f"torch {torch.__version__}" in said[0], said
    assert len(calls) == 2, "DCP planned both loads"
    for target in targets:
        assert torch.equal(target["w"], torch.arange(4.0))


def test_nothing_is_said_outside_dcps_calls_nor_for_a_planner_of_ones_own(tmp_path, monkeypatch):
    path = str(tmp_path / "s.zarr")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"w": torch.ones(2)}, storage_writer=ZarrWriter(path), planner=DCPsPlanning())
        dcp.save({"w": torch.ones(2)}, storage_writer=ZarrWriter(str(tmp_path / "z.zarr")), planner=ZarrSavePlanner())
        _moved(monkeypatch, "_SAVE")
        _moved(monkeypatch, "_LOAD")
        assert dcp_internals.dcp_save_call() is None  # a writer's method called by a test, not by dcp.save
        assert dcp_internals.dcp_load_wrapper() is None and dcp_internals.dcp_load_planner() is None
        ZarrReader(path).read_metadata()
    assert _unverified(caught) == []


# -- one planner, two calls at once --------------------------------------------------------------------------------


class Held:
    """A point a call's thread stops at until the test lets it go."""

    def __init__(self):
        self.reached, self.go = threading.Event(), threading.Event()

    def stop(self):
        self.reached.set()
        assert self.go.wait(WAIT_S), "never let go"


class WriterHeldAtFinish(ZarrWriter):
    held: Held

    def finish(self, *args, **kwargs):
        self.held.stop()
        return super().finish(*args, **kwargs)


class WriterHeldAtWrite(ZarrWriter):
    held: Held

    def write_data(self, *args, **kwargs):
        self.held.stop()
        return super().write_data(*args, **kwargs)


class WriterCheckingFirst(ZarrWriter):
    """ZarrWriter asking, as DCP sets the planner up next, whether another save is using it."""

    def storage_meta(self):
        dcp_internals.check_save_planner_unshared()
        return super().storage_meta()


class ReaderHeldAtRead(ZarrReader):
    held: Held

    def read_data(self, *args, **kwargs):
        self.held.stop()
        return super().read_data(*args, **kwargs)


def _in_thread(name: str, fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run():
        try:
            outcome.append(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001  (the test reads it)
            outcome.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread, outcome


def _refusals(exc: BaseException) -> list[str]:
    return [str(c) for c in causes(exc) if "was given the" in str(c)]


@pytest.mark.parametrize("writers", [(WriterHeldAtFinish, ZarrWriter), (WriterHeldAtWrite, WriterCheckingFirst)],
                         ids=["held-at-finish", "held-at-write"])
def test_a_save_given_a_planner_another_save_is_using_is_refused_and_the_other_comes_out_right(tmp_path, writers):
    """Refused when the writer is set up; from before DCP sets the planner up (the writer's storage_meta) where the
    save already running still reads it (its write_data)."""
    planner, held = DefaultSavePlanner(), Held()
    first = writers[0](str(tmp_path / "first.zarr"))
    first.held = held
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 1}
    thread, outcome = _in_thread("first-save", dcp.save, state, storage_writer=first, planner=planner)
    assert held.reached.wait(WAIT_S)
    try:
        with pytest.raises(CheckpointException) as raised:
            dcp.save({"w": torch.zeros(3, 4), "step": 2}, storage_writer=writers[1](str(tmp_path / "second.zarr")),
                     planner=planner)
    finally:
        held.go.set()
        thread.join(WAIT_S)
    refused = [c for c in causes(raised.value) if isinstance(c, SharedPlannerError)]
    assert len(refused) == 1, causes(raised.value)
    text = str(refused[0])
    assert "DefaultSavePlanner" in text and "'first-save'" in text and "its own planner" in text, text
    assert outcome and outcome[0].state_dict_metadata == {}, outcome
    assert_state_equal(open_checkpoint(str(tmp_path / "first.zarr")).load_full_state_dict(), state)
    assert not (tmp_path / "second.zarr").exists()
    assert vars(planner).keys().isdisjoint(TAKEN_OVER)


def test_a_planner_left_taken_over_by_a_save_that_failed_in_another_thread_is_given_back_silently(tmp_path):
    class Failing(ZarrWriter):
        def prepare_local_plan(self, plan):
            raise OSError("the disk went away")

    planner = DefaultSavePlanner()
    thread, outcome = _in_thread("failed-save", dcp.save, {"w": torch.ones(2)},
                                 storage_writer=Failing(str(tmp_path / "failed.zarr")), planner=planner)
    thread.join(WAIT_S)
    assert isinstance(outcome[0], CheckpointException) and TAKEN_OVER <= vars(planner).keys()
    state = {"w": torch.full((2,), 5.0)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metadata = dcp.save(state, storage_writer=ZarrWriter(str(tmp_path / "next.zarr")), planner=planner)
    assert metadata.state_dict_metadata == {} and _unverified(caught) == []
    assert_state_equal(open_checkpoint(str(tmp_path / "next.zarr")).load_full_state_dict(), state)
    assert vars(planner).keys().isdisjoint(TAKEN_OVER)


def test_a_load_given_a_planner_another_load_is_using_is_refused_and_the_other_comes_out_right(tmp_path):
    path = str(tmp_path / "s.zarr")
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}
    dcp.save(state, storage_writer=ZarrWriter(path))
    planner, held = DefaultLoadPlanner(), Held()
    reader = ReaderHeldAtRead(path)
    reader.held = held
    first = {"w": torch.zeros(3, 4), "b": torch.zeros(2)}
    thread, outcome = _in_thread("first-load", dcp.load, first, storage_reader=reader, planner=planner)
    assert held.reached.wait(WAIT_S)
    second = {"w": torch.zeros(3, 4), "b": torch.zeros(2)}
    try:
        with pytest.raises(CheckpointException) as raised:
            dcp.load(second, storage_reader=ZarrReader(path), planner=planner)
    finally:
        held.go.set()
        thread.join(WAIT_S)
    refused = _refusals(raised.value)  # DCP reports read_metadata's error in an AssertionError of its own
    assert refused and "DefaultLoadPlanner" in refused[0] and "'first-load'" in refused[0], causes(raised.value)
    assert outcome == [None]
    assert_state_equal(first, state)
    assert torch.equal(second["w"], torch.zeros(3, 4)), "the refused load read nothing"


def test_looking_at_other_threads_keeps_nothing_of_the_save_alive(tmp_path):
    """The search of other threads' frames leaves no reference cycle behind: the saved tensor goes with its last
    reference, the garbage collector not asked."""
    idle = Held()
    thread, _ = _in_thread("idle", idle.stop)
    tensor = torch.ones(4, 3)
    watch = weakref.ref(tensor)
    collecting = gc.isenabled()
    gc.disable()
    try:
        dcp.save({"w": tensor}, storage_writer=ZarrWriter(str(tmp_path / "s.zarr")), planner=DefaultSavePlanner())
        del tensor
        assert watch() is None, "the saved tensor is still referenced after the save"
    finally:
        if collecting:
            gc.enable()
        idle.go.set()
        thread.join(WAIT_S)


def test_an_async_save_running_refuses_a_save_given_its_planner_and_not_one_after_it(tmp_path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    planner, held = DefaultSavePlanner(), Held()
    writer = WriterHeldAtFinish(str(tmp_path / "async.zarr"))
    writer.held = held
    state = {"w": torch.arange(8.0)}
    future = dcp.async_save(state, storage_writer=writer, planner=planner,
                            async_checkpointer_type=AsyncCheckpointerType.THREAD)
    assert held.reached.wait(WAIT_S)
    try:
        with pytest.raises(CheckpointException) as raised:
            dcp.save({"w": torch.ones(3)}, storage_writer=ZarrWriter(str(tmp_path / "refused.zarr")), planner=planner)
    finally:
        held.go.set()
    assert any(isinstance(c, SharedPlannerError) for c in causes(raised.value)), causes(raised.value)
    assert future.result().state_dict_metadata == {}
    assert_state_equal(open_checkpoint(str(tmp_path / "async.zarr")).load_full_state_dict(), state)
    after = {"w": torch.full((3,), 2.0)}
    assert dcp.save(after, storage_writer=ZarrWriter(str(tmp_path / "after.zarr")), planner=planner
                    ).state_dict_metadata == {}
    assert_state_equal(open_checkpoint(str(tmp_path / "after.zarr")).load_full_state_dict(), after)
