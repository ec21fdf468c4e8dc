"""Every rank of a save or load must name the same checkpoint. Each rank's plan names the checkpoint the rank saves
to or loads from, and the coordinator compares the names before anything is written or read (``checked``). If
ranks named different checkpoints, the other ranks would write into the coordinator's staging area, or read
from another checkpoint.

The name travels in the plan that DCP already gathers to the coordinator, as one more field of a ``SavePlan`` or
``LoadPlan`` subclass. It adds a path's bytes per rank and no collective. It is not in ``storage_data``: DCP's
planners, and the writer's take-over of them, tell the save's own messages (protocol.py) by their type there.
DCP's planners pass the subclass on (``dataclasses.replace``).

Only this save's names are compared. A caching planner (``DefaultSavePlanner(enable_plan_caching=True)``, not
taken over) sends an unchanged local plan as a placeholder without a name, and DCP's coordinator puts back the plan
it cached at an earlier save, with that save's name: the very object the coordinator compared then, which it
marked. Marked names and plans without a name are left out.

What is compared: a local directory's absolute path, as the storage layer opens it (``directory_of``), so
``ckpt``, ``./ckpt/`` and ``/work/ckpt`` are one checkpoint to a rank whose working directory is ``/work``; a URL
without its trailing slashes; and a zarr store object's label (its URL where zarr can tell one), marked as a
store. A store object and a path never name the same checkpoint: a store is written in place, a path through its
staging area.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TypeVar

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.planner import LoadPlan, SavePlan

from dcp_zarr.errors import PlanMismatchError
from dcp_zarr.planning.replicas import ranks_text
from dcp_zarr.storage import store_objects
from dcp_zarr.storage.location import directory_of

_LISTED = 8  # checkpoints named in a message; a path with the rank in it would otherwise list every rank's


class CheckpointName:
    """What a rank named: ``key``, what ranks must agree on, and ``given``, as the rank gave it (for messages)."""

    __slots__ = ("key", "given", "compared")

    def __init__(self, key: str, given: str):
        self.key = key
        self.given = given
        # set by the coordinator that compared it: met again, it stands in a plan that DCP cached at an earlier save
        self.compared = False

    def __reduce__(self):
        return CheckpointName, (self.key, self.given)  # as made: a rank sends a name never compared

    def __repr__(self) -> str:
        return f"CheckpointName({self.key!r}, {self.given!r})"

    def shown(self) -> str:
        """As given, and as compared where that says more than a trailing slash (a relative path's directory)."""
        return self.given if self.key in (self.given, self.given.rstrip("/")) else f"{self.given} ({self.key})"


def checkpoint_name(path: str, store=None) -> CheckpointName:
    """The name of the checkpoint at ``path``, or of the zarr store object ``store``."""
    if store is not None:
        label = f"store={store_objects.label(store)}"
        return CheckpointName(label, label)
    directory = directory_of(path) if path else None
    key = directory if directory is not None else path.rstrip("/") or path
    # one string where they are equal, as they mostly are: pickled once into the plan every rank sends
    return CheckpointName(path if key == path else key, path)


@dataclasses.dataclass(frozen=True)
class NamedSavePlan(SavePlan):
    """A rank's ``SavePlan``, with the checkpoint the rank saves to."""

    checkpoint: CheckpointName | None = None


@dataclasses.dataclass
class NamedLoadPlan(LoadPlan):
    """A rank's ``LoadPlan``, with the checkpoint the rank loads from."""

    checkpoint: CheckpointName | None = None


Plan = TypeVar("Plan", SavePlan, LoadPlan)


def named(plan: Plan, name: CheckpointName) -> Plan:
    """``plan`` with ``name``, to be gathered to the coordinator."""
    kind = NamedSavePlan if isinstance(plan, SavePlan) else NamedLoadPlan
    return kind(**_fields(plan), checkpoint=name)


def checked(plans: list[Plan], *, saving: bool) -> list[Plan]:
    """The coordinator's ``plans`` without their names, once this save's names agree. Raises ``PlanMismatchError``,
    naming each checkpoint and the ranks that named it, where they do not."""
    names = [(rank, getattr(plan, "checkpoint", None)) for rank, plan in enumerate(plans)]
    # left out: a placeholder, and a plan DCP cached at an earlier save
    this_save = [(rank, name) for rank, name in names if name is not None and not name.compared]
    ranks_of: dict[str, list[int]] = defaultdict(list)
    shown: dict[str, str] = {}
    for rank, name in this_save:
        name.compared = True  # marked first: a save refused here may leave its plans in DCP's cache too
        ranks_of[name.key].append(rank)
        shown.setdefault(name.key, name.shown())
    if len(ranks_of) > 1:
        raise PlanMismatchError(_message([(shown[key], ranks) for key, ranks in ranks_of.items()], saving))
    return [_unnamed(plan) for plan in plans]


def _unnamed(plan: Plan) -> Plan:
    if isinstance(plan, NamedSavePlan):
        return SavePlan(**_fields(plan))
    if isinstance(plan, NamedLoadPlan):
        return LoadPlan(**_fields(plan))
    return plan


def _fields(plan) -> dict:
    """The fields of DCP's plan class that ``plan`` has (a named plan's, without its name)."""
    base = SavePlan if isinstance(plan, SavePlan) else LoadPlan
    return {field.name: getattr(plan, field.name) for field in dataclasses.fields(base)}


def _message(groups: list[tuple[str, list[int]]], saving: bool) -> str:
    """``rank 0 saves to /a/ckpt, rank 1 to /b/ckpt: ...``, each checkpoint once with the ranks that named it,
    in the order of their first rank."""
    verb, preposition = ("saves", "to") if saving else ("loads", "from")
    parts = []
    for i, (shown, ranks) in enumerate(groups[:_LISTED]):
        who = ranks_text(ranks)
        if i == 0:
            parts.append(f"{who} {verb if len(ranks) == 1 else verb[:-1]} {preposition} {shown}")
        else:
            parts.append(f"{who} {preposition} {shown}")
    if len(groups) > _LISTED:
        others = sum(len(ranks) for _, ranks in groups[_LISTED:])
        parts.append(f"and {others} other rank{'s' if others > 1 else ''} {preposition} {len(groups) - _LISTED} other "
                     f"checkpoint{'s' if len(groups) - _LISTED > 1 else ''}")
    owner, call, done = (("ZarrWriter", "dcp.save", "Nothing was written") if saving else
                         ("ZarrReader", "dcp.load", "No chunk was read"))
    return (", ".join(parts) + f": every rank must name the same checkpoint (pass every rank's {owner} the same "
            f"path or URL, or store= of the same store, or {call} the same checkpoint_id). {done}")
