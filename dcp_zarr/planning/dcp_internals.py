"""Everything dcp_zarr reads or sets inside a ``torch.distributed.checkpoint`` (DCP) call under way, in one place: the
frames of a ``dcp.save`` or ``dcp.load``, the planner methods taken over for one call and given back, and DCP's plan
cache. torch's private names themselves are imported by ``dcp_zarr/torch_private.py`` alone. Verified on the torch
releases of ``torch_private.VERIFIED_TORCH``; ``tests/planning/test_dcp_internals.py`` and
``tests/planning/test_plain_save.py`` fail, saying which, the day torch keeps them elsewhere.

DCP tells a storage writer or reader nothing of the call it serves, nor hands it the planner before the plans are
gathered. Both are in the call: ``local_step`` of ``_save_state_dict`` holds DCP's ``planner``, its ``_DistWrapper``
``distW`` (whose ``group`` is the save's process group) and the ``storage_writer``, and calls the writer's
``set_up_storage_writer`` right before ``planner.create_local_plan()``; ``local_step`` of ``_load_state_dict`` holds
``planner`` and ``distW``, and calls the reader's ``read_metadata`` and ``set_up_storage_reader`` right before
``planner.create_local_plan()``. With them a plain ``dcp.save(sd, storage_writer=ZarrWriter(p))`` plans locally, as
``ZarrSavePlanner`` does (a WriteItem says neither how a DTensor is split nor which ranks hold the same box), a load's
read items are made in arithmetic (``load_plan.py``), and its root ``zarr.json`` is read by its coordinator alone
(reader.py): a broadcast is safe only when every rank of the load makes it, which only ``distW`` knows.

DCP's own planner (a ``DefaultSavePlanner`` or ``DefaultLoadPlanner`` whose planning methods are DCP's) is taken over
for one call: instance attributes, which the call itself removes (``give_back_save``, ``give_back_load``). A call that
fails before that leaves them, and the next call through the planner gives them back first. A planner that plans for
itself is left alone. Where the frames are not found while a ``dcp.save`` or ``dcp.load`` is under way (another
torch), the writer and reader follow DCP's protocol, correct and slower, and say so once a process
(``UnverifiedTorchWarning``). DCP keeps a call's state dict on its planner, so one planner object given to two calls
at once (threads) would mix them: that is refused, naming the planner and the threads (``SharedPlannerError``).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, NamedTuple

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)
from dcp_zarr.torch_floor import release

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, SavePlanner

from dcp_zarr.errors import SharedPlannerError, UnverifiedTorchWarning
from dcp_zarr.planning.protocol import Summary, Ticket
from dcp_zarr.torch_private import VERIFIED_TORCH, torch_2_3_keys

__all__ = [
    "SAVE_PLANNER_STATE", "SaveCall", "check_save_planner_unshared", "dcp_save_call", "take_over_save",
    "give_back_save", "dcp_load_wrapper", "dcp_load_planner", "take_over_load", "give_back_load",
    "is_dcps_save_planner", "is_dcps_load_planner", "save_lookup_is_dcps", "load_lookup_is_dcps", "keeps_dcps",
    "uses_plan_cache", "cached_local_plan", "cached_plans", "reported_by_dcp_load",
]

# What a DefaultSavePlanner keeps of one save (a caching planner's pending plan included): not options.
SAVE_PLANNER_STATE = ("state_dict", "plan", "metadata", "global_plan", "_pending_local_plan")


class _Call(NamedTuple):
    """Where the verified releases keep a DCP call's state."""

    name: str
    module: str  # the DCP module whose functions run the call
    entries: frozenset[str]  # its functions (or a later torch's, in another DCP module) that run one
    runner: str  # the one whose frame holds the planner from its set-up to the call's end
    step: str  # the function whose frame holds planner and distW while the writer or reader is set up
    slower: str  # what dcp_zarr does without them


_SAVE = _Call(
    name="dcp.save", module="torch.distributed.checkpoint.state_dict_saver",
    entries=frozenset({"save", "async_save", "save_state_dict", "_save_state_dict"}), runner="_save_state_dict",
    step="local_step", slower="dcp.save(..., storage_writer=ZarrWriter(...)) with DCP's own planner follows DCP's "
    "planning instead of planning on every rank")
_LOAD = _Call(
    name="dcp.load", module="torch.distributed.checkpoint.state_dict_loader",
    entries=frozenset({"load", "load_state_dict", "_load_state_dict"}), runner="_load_state_dict",
    step="local_step", slower="every rank of a dcp.load reads the root zarr.json itself, and DCP plans the load's "
    "read items")
_DCP = "torch.distributed.checkpoint"
# From the frame asking to DCP's step: the writer's or reader's method and what it calls on the way (a subclass's
# override, a decorator), with room to spare.
_STEP_DEPTH = 32
_TAKEN_OVER = "taken_over_by_dcp_zarr"
_warned: set[str] = set()

# DCP's methods a save planner must not override to be taken over: what it plans and what it hands the writer. A
# subclass that overrides any of them (a planner that rewrites items, transforms tensors) keeps DCP's protocol.
_SAVE_PLANNING = ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan", "resolve_data",
                  "lookup_object", "transform_object")
_SAVE_TAKEN_OVER = ("create_local_plan", "create_global_plan", "finish_plan")
_SAVE_LOOKUP = ("resolve_data", "lookup_object", "transform_object")
# ... a load planner: what it is set up with and what it plans; and how it finds the tensor a read item fills.
_LOAD_PLANNING = ("set_up_planner", "create_local_plan")
_LOAD_TAKEN_OVER = ("create_local_plan",)
_LOAD_LOOKUP = ("resolve_tensor", "lookup_tensor", "transform_tensor")


# -- the frames of the call under way -----------------------------------------------------------------------------


def _step_frame(call: _Call, warn: bool = True) -> FrameType | None:
    """The frame of DCP's ``call.step`` above the caller; None (and, with ``warn``, a warning once a process where a
    ``call`` is under way all the same) where there is none."""
    start = sys._getframe(2)
    frame: FrameType | None = start
    for _ in range(_STEP_DEPTH):
        if frame is None:
            break
        if frame.f_code.co_name == call.step and frame.f_globals.get("__name__") == call.module:
            return frame
        frame = frame.f_back
    if warn and _under_way(call, start):
        _warn_once(call, f"no {call.step} of {call.module} on the stack")
    return None


def _under_way(call: _Call, frame: FrameType | None) -> bool:
    """Whether one of DCP's functions that run a ``call`` is on the stack: a writer or reader called by DCP's save
    or load, not by a test or by DCP elsewhere (``load_sharded_optimizer_state_dict`` reads metadata itself)."""
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if frame.f_code.co_name in call.entries and (module == _DCP or module.startswith(_DCP + ".")):
            return True
        frame = frame.f_back
    return False


def _warn_once(call: _Call, missing: str) -> None:
    if call.name in _warned:
        return
    _warned.add(call.name)
    verified = ", ".join(f"{major}.{minor}" for major, minor in VERIFIED_TORCH)
    warnings.warn(f"dcp_zarr: torch {torch.__version__} does not keep a {call.name}'s planner and process group "
                  f"where torch {verified} keep them ({missing}), so {call.slower}: correct, and slower. dcp_zarr "
                  f"was verified on torch {verified}", UnverifiedTorchWarning, stacklevel=2)


def _threads_using(planner, call: _Call) -> list[str]:
    """The names of the other threads running a DCP ``call`` with ``planner``. (Not a thread in ``async_save``: the
    save it started runs in another thread, which is the one using the planner.)"""
    frames = sys._current_frames()
    # This thread's own frame in the dict would hold the dict: a cycle that keeps the frames of the call under way,
    # and so its state dict, alive until the garbage collector runs.
    del frames[threading.get_ident()]
    module = sys.modules.get(call.module)
    if not frames or module is None:
        return []
    dcps = vars(module)
    holders = []
    for ident, frame in frames.items():
        found: FrameType | None = frame
        while found is not None:
            if (found.f_globals is dcps and found.f_code.co_name == call.runner
                    and found.f_locals.get("planner") is planner):
                holders.append(ident)
                break
            found = found.f_back
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return [names.get(ident, f"<thread {ident}>") for ident in holders]


def _shared(planner, call: _Call, others: list[str]) -> SharedPlannerError:
    kind = type(planner).__name__
    where = f"the {call.name} in thread {', '.join(repr(n) for n in others)}" if others else f"another {call.name}"
    return SharedPlannerError(
        f"{call.name} in thread {threading.current_thread().name!r} was given the {kind} that {where} is using: DCP "
        f"keeps the state dict of one {call.name} on its planner (set_up_planner), so two calls at once would mix "
        f"their state. Give each {call.name} its own planner ({call.name}(..., planner={kind}(...)) per call), or "
        "wait for the other to finish")


def _refuse_if_shared(planner, call: _Call) -> None:
    others = _threads_using(planner, call)
    if others:
        raise _shared(planner, call, others)


# -- planner methods ----------------------------------------------------------------------------------------------


def keeps_dcps(planner, base: type, names: Iterable[str]) -> bool:
    """``planner`` is a ``base`` whose class and instance override none of the methods ``names``."""
    if not isinstance(planner, base):
        return False
    cls = type(planner)
    return all(getattr(cls, name) is getattr(base, name) and name not in vars(planner) for name in names)


def is_dcps_save_planner(planner) -> bool:
    """A ``DefaultSavePlanner`` (caching or not, deduplicating to the lowest rank or not) whose planning is DCP's."""
    return keeps_dcps(planner, DefaultSavePlanner, _SAVE_PLANNING)


def is_dcps_load_planner(planner) -> bool:
    """A ``DefaultLoadPlanner`` whose set-up and planning are DCP's (any ``allow_partial_load``, flattening)."""
    return keeps_dcps(planner, DefaultLoadPlanner, _LOAD_PLANNING)


def save_lookup_is_dcps(planner) -> bool:
    """Whether ``planner.resolve_data`` of a tensor item is the state dict's tensor, as DefaultSavePlanner's is."""
    return keeps_dcps(planner, DefaultSavePlanner, _SAVE_LOOKUP)


def load_lookup_is_dcps(planner) -> bool:
    """Whether ``planner.resolve_tensor`` is the state dict's tensor (narrowed), as DefaultLoadPlanner's is."""
    return keeps_dcps(planner, DefaultLoadPlanner, _LOAD_LOOKUP)


def _take_over(planner, *methods: Callable) -> None:
    for method in methods:
        vars(method)[_TAKEN_OVER] = True
        setattr(planner, method.__name__, method)


def _give_back(planner, names: Iterable[str]) -> None:
    """Remove what a take-over set (only that: a planner's own instance attributes stay)."""
    for name in names:
        if getattr(vars(planner).get(name), _TAKEN_OVER, False):
            del vars(planner)[name]


# -- a save -------------------------------------------------------------------------------------------------------


class SaveCall(NamedTuple):
    planner: DefaultSavePlanner
    group: Any  # the process group the save runs on; None: the default group, or no process group at all
    writer: Any  # the storage writer DCP was given


def check_save_planner_unshared() -> None:
    """Raises ``SharedPlannerError`` where the planner of the ``dcp.save`` calling us is in another thread's
    ``dcp.save``. For the writer's ``storage_meta``, which DCP calls right before it sets the planner up: so the
    other save keeps its state dict."""
    frame = _step_frame(_SAVE, warn=False)
    planner = None if frame is None else frame.f_locals.get("planner")
    if planner is not None:
        _refuse_if_shared(planner, _SAVE)


def dcp_save_call() -> SaveCall | None:
    """The planner, process group and writer of the ``dcp.save`` calling us, if its planner is DCP's own. Raises
    ``SharedPlannerError`` where another thread's ``dcp.save`` is using the same planner."""
    frame = _step_frame(_SAVE)
    if frame is None:
        return None
    found = frame.f_locals
    planner, wrapper, writer = found.get("planner"), found.get("distW"), found.get("storage_writer")
    if planner is not None:
        _refuse_if_shared(planner, _SAVE)
        give_back_save(planner)  # a save that failed before its finish_plan left it taken over
    if planner is not None and not is_dcps_save_planner(planner):
        return None
    if planner is None or writer is None or wrapper is None or not hasattr(wrapper, "group"):
        _warn_once(_SAVE, f"its {_SAVE.step} holds no planner, distW or storage_writer")
        return None
    return SaveCall(planner, wrapper.group, writer)


def take_over_save(call: SaveCall, plan_locally: Callable[[DefaultSavePlanner, Any], SavePlan]) -> None:
    """For this save, the planner plans as ``ZarrSavePlanner`` does: each rank's plan is ``plan_locally(planner,
    call.group)`` (its items, made in arithmetic, and state dict, for the writer), the coordinator's global plan is
    the writer's messages as they are (nothing to deduplicate or cache: they are digests), and every rank's plan is
    the writer's answer, after which the planner is DCP's again. Should a save fail before that, the next save through
    this planner gives it back first: here if the writer is not the one that took it over, or where a message is not
    the writer's."""
    planner = call.planner
    state_dict = getattr(planner, "state_dict", None)  # DCP set it up for this save before the writer's set-up

    def create_local_plan() -> SavePlan:
        frame = _step_frame(_SAVE, warn=False)
        if frame is None or frame.f_locals.get("storage_writer") is not call.writer:
            _refuse_if_shared(planner, _SAVE)  # another writer's save, while the save that took it over runs
            give_back_save(planner)  # else that save failed and left it taken over
            return planner.create_local_plan()
        if planner.state_dict is not state_dict:  # set up since by a save of another thread
            raise _shared(planner, _SAVE, _threads_using(planner, _SAVE))
        planner.plan = plan_locally(planner, call.group)
        return planner.plan

    def create_global_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if not any(isinstance(plan.storage_data, Summary) for plan in all_plans):
            give_back_save(planner)  # not this save's messages: a save that failed left the planner taken over
            return planner.create_global_plan(all_plans)
        # Some ranks planned locally and some not: passed on as they are, for the writer to refuse by name.
        planner.metadata = Metadata(state_dict_metadata={})  # the store's manifest is the checkpoint's metadata
        planner.global_plan = all_plans
        return all_plans, planner.metadata

    def finish_plan(new_plan: SavePlan) -> SavePlan:
        give_back_save(planner)
        if not isinstance(new_plan.storage_data, Ticket):  # as above
            return planner.finish_plan(new_plan)
        planner.plan = new_plan
        return new_plan

    _take_over(planner, create_local_plan, create_global_plan, finish_plan)
    vars(planner).pop("_pending_local_plan", None)  # a caching planner's: this save's plan is not DCP's to cache


def give_back_save(planner) -> None:
    _give_back(planner, _SAVE_TAKEN_OVER)


# -- DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)), seen through --------------------------------
# From a caching planner's second save on, a rank whose local plan did not change sends SavePlan([], usable=False),
# and the coordinator's planner hands the writer "deltas", empty unusable plans, instead of the global plan; each
# rank's finish_plan then takes the final plan it cached at the last save, with that save's storage_data. The plans
# live in class attributes of SavePlanner, keyed by the planner's class name: the writer reads them there and answers
# with complete, usable plans, so each save gets its own staging location and its items.


def uses_plan_cache(plans: list[SavePlan]) -> bool:
    """Whether ``plans`` are a caching planner's deltas (some plan stands for one in its cache)."""
    return any(not plan.usable for plan in plans)


def cached_local_plan() -> SavePlan:
    """This rank's local plan as the caching planner last sent it (what an unusable plan stands for)."""
    return _only_cache("_cached_save_plan")


def cached_plans() -> tuple[list[SavePlan], list[SavePlan]]:
    """(every rank's local plan, the deduplicated global plan), on the coordinator of a caching planner's save."""
    return _only_cache("_cached_all_plans"), _only_cache("_cached_global_plan")


def _only_cache(attribute: str):
    caches = getattr(SavePlanner, attribute, None) or {}
    if len(caches) != 1:
        found = ", ".join(sorted(caches)) or "none"
        raise RuntimeError(
            f"DCP's planner sent a cached (unusable) plan, and ZarrWriter cannot tell whose cache holds it: "
            f"SavePlanner.{attribute} has {len(caches)} entries ({found}). Use one caching planner class per "
            "process, or dcp_zarr.ZarrSavePlanner, which needs no cache")
    return next(iter(caches.values()))


# -- a load -------------------------------------------------------------------------------------------------------


def dcp_load_wrapper():
    """DCP's ``_DistWrapper`` of the ``dcp.load`` calling us, or None. Raises ``SharedPlannerError`` where the load's
    planner is in another thread's ``dcp.load``: called from the reader's ``read_metadata``, which DCP calls before it
    sets the planner up, so the other load keeps its state dict. (DCP reports an error of ``read_metadata`` inside
    its own AssertionError: the message stays, the type does not.)"""
    frame = _step_frame(_LOAD)
    if frame is None:
        return None
    planner = frame.f_locals.get("planner")
    if planner is not None:
        _refuse_if_shared(planner, _LOAD)
    wrapper = frame.f_locals.get("distW")
    if wrapper is not None and hasattr(wrapper, "broadcast_object") and hasattr(wrapper, "use_dist"):
        return wrapper
    _warn_once(_LOAD, f"its {_LOAD.step} holds no distW")
    return None


# torch 2.11's and 2.12's dcp.load catch any Exception of read_metadata and raise AssertionError("metadata is None")
# without it (2.13 adds its message): a reader's reason (not a checkpoint, incomplete, a planner in use) was lost.
_LOAD_DROPS_METADATA_ERRORS = release(torch.__version__) < (2, 13)


class MetadataReadError(BaseException):
    """A ``read_metadata`` error carried past DCP's ``except Exception`` of torch 2.11 and 2.12: DCP reports it in its
    ``CheckpointException`` (as 2.13 reports the original inside its AssertionError). Raised only inside ``dcp.load``;
    the original is its ``__cause__``."""


def reported_by_dcp_load(exc: Exception) -> BaseException:
    """What ``read_metadata`` raises for ``exc`` so that the ``dcp.load`` calling it reports it: ``exc`` itself, or
    on torch 2.11 and 2.12 inside a ``dcp.load``, a ``MetadataReadError`` naming it."""
    if not _LOAD_DROPS_METADATA_ERRORS or _step_frame(_LOAD, warn=False) is None:
        return exc
    carried = MetadataReadError(f"{type(exc).__name__}: {exc}")
    carried.__cause__ = exc
    return carried


def dcp_load_planner():
    """The LoadPlanner of the ``dcp.load`` calling us (DCP's or the caller's), or None. Raises
    ``SharedPlannerError`` where another thread's ``dcp.load`` is using the same planner."""
    frame = _step_frame(_LOAD)
    if frame is None:
        return None
    planner = frame.f_locals.get("planner")
    if planner is None:
        _warn_once(_LOAD, f"its {_LOAD.step} holds no planner")
        return None
    _refuse_if_shared(planner, _LOAD)
    return planner


def take_over_load(planner, metadata: Metadata, read_items: Callable[[dict, Metadata, bool], list[ReadItem]]
                   ) -> bool:
    """Make the next ``planner.create_local_plan()`` plan with ``read_items(state_dict, metadata, strict)``, once,
    if ``planner`` is DCP's own and set up with ``metadata``; whether it was taken over."""
    give_back_load(planner)
    if not is_dcps_load_planner(planner) or planner.metadata is not metadata:
        return False

    def create_local_plan() -> LoadPlan:
        give_back_load(planner)
        if planner.metadata is not metadata:  # set up again since: by a load of another thread, or this load failed
            _refuse_if_shared(planner, _LOAD)  # after set_up_storage_reader and the next is another reader's
            return planner.create_local_plan()
        unasked = metadata.state_dict_metadata.keys() - planner.state_dict.keys()
        if planner.flatten_state_dict and unasked and _may_be_of_torch_2_3(planner.original_state_dict, unasked):
            return planner.create_local_plan()  # DCP's own: it switches the planner to torch 2.3's key form
        return LoadPlan(read_items(planner.state_dict, metadata, not planner.allow_partial_load))

    _take_over(planner, create_local_plan)
    return True


def give_back_load(planner) -> None:
    _give_back(planner, _LOAD_TAKEN_OVER)


def _may_be_of_torch_2_3(original_state_dict: dict, unasked: set[str]) -> bool:
    """DCP's check before it plans a load that leaves saved keys out (a model alone from a training checkpoint):
    whether some of them are keys of the state dict flattened as torch 2.3 did, and so the checkpoint is of that
    form. True also where DCP's own planning must decide (``torch_private.torch_2_3_keys``)."""
    keys = torch_2_3_keys(original_state_dict)
    return keys is None or not keys.isdisjoint(unasked)
