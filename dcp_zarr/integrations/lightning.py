"""Lightning strategies that save and load distributed checkpoints as dcp_zarr stores: a user changes the strategy and
nothing else.

    Trainer(strategy=ZarrModelParallelStrategy(data_parallel_size=8))    # was: ModelParallelStrategy(...)
    Fabric(strategy=ZarrFabricModelParallelStrategy(parallelize_fn))     # was: fabric's ModelParallelStrategy(...)
    ZarrFSDPStrategy(...) / ZarrFabricFSDPStrategy(...)                   # FSDP1, state_dict_type="sharded"

Lightning's distributed-checkpoint strategies give DCP no writer or reader, and use no CheckpointIO plugin: their
``save_checkpoint`` / ``load_checkpoint`` call module-level helpers, ``_distributed_checkpoint_save(state, path)``
(``dcp.save(state, checkpoint_id=path)``: DCP's FileSystemWriter) and ``_distributed_checkpoint_load(state, path)``,
by their names in the strategy's module (FSDP1 also reads optimizer state through a ``FileSystemReader`` it imports
from ``torch.distributed.checkpoint`` as it runs). While a strategy of this module saves or loads, those names hold
stand-ins that save with ``ZarrWriter`` + ``ZarrSavePlanner`` and load with ``ZarrReader`` + ``ZarrLoadPlanner``;
everything else is Lightning's own code: the state dicts, ``meta.pt`` beside the store (rank 0's ``torch.save`` of
the rest of the checkpoint), the checkpoint's name, ``ModelCheckpoint``, resuming. A stand-in routes only calls
made inside such a save or load (a context variable says which): a Lightning strategy saving on another thread
meanwhile still gets Lightning's helper. Checkpoints Lightning's own strategies wrote (a ``.metadata`` file and
``.distcp`` shards) load through Lightning's helper, so a job can switch strategy and resume from its last one.
Each strategy takes two arguments of its own besides Lightning's, checked when the strategy is built:
``compression``, passed to ``ZarrWriter`` (``ZarrModelParallelStrategy(..., compression="zstd")`` compresses the
floating-point arrays of every checkpoint it saves; None, the default, stores them as they are); and ``incremental``
(default False): True saves each checkpoint incrementally (docs/incremental.md), its unchanged chunks hard links to
those of the newest complete checkpoint this strategy saved before in this process (rank 0's choice, broadcast), in
full where there is none (the first save, or every earlier one deleted or replaced since). A checkpoint that
``ModelCheckpoint`` deletes (``save_top_k``) or a save replaces (``last.ckpt``) takes nothing from those that link its
chunks.

The Trainer's two strategies also take ``ModelCheckpoint``'s deletions off the training's thread, as
``CheckpointManager`` does its retention's (lifecycle/background.py): Lightning removes a checkpoint it no longer keeps
in ``remove_checkpoint``, on rank 0, right after a save, and a store of ~1,000 files took seconds. A checkpoint
directory is renamed aside at once, into the staging directory beside it (its name is free at once, and no half-deleted
store is ever found under it: what a crash left there is removed before the next job's first removal, or by ``dcp-zarr
prune``), then removed on a thread of the strategy's own, one at a time, in order; ``teardown`` (the end of ``fit``)
waits for them. A removal that failed is raised, naming it, by the next ``remove_checkpoint`` or by ``teardown``. A file
(a full state dict) or a link (``save_last="link"``) is removed by Lightning's own code, at once.

Written against lightning 2.6.6 (``WRITTEN_FOR``). Importing this module checks that each Lightning function on the
way still looks the helpers up by those names, in the module where they are swapped, and that they take (state,
path); if not, it raises ``FrameworkVersionError`` naming both versions. After every save and load, a checkpoint that
did not pass through dcp_zarr raises ``FrameworkVersionError`` too, rather than leaving a FileSystemWriter checkpoint
where a zarr store was promised.
"""

from __future__ import annotations

import dis
import inspect
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_zarr.format.compression import Compression
from dcp_zarr.format.manifest import ROOT_KEY
from dcp_zarr.integrations.framework import (
    compression_choice,
    import_framework,
    incremental_choice,
    missing_attributes,
    refuse_unless_committed,
    require_internals,
    signature_with_compression,
)
from dcp_zarr.lifecycle.background import BackgroundDeletions, finishing_first
from dcp_zarr.lifecycle.listing import DELETING_MARK
from dcp_zarr.lifecycle.rank0 import decided_by_rank0
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.lifecycle.root_storage import RootStorage
from dcp_zarr.lifecycle.step_forms import parse_step
from dcp_zarr.offline import is_dcp_directory
from dcp_zarr.optim.load_planner import ZarrLoadPlanner
from dcp_zarr.planning.save_planner import ZarrSavePlanner
from dcp_zarr.reader import ZarrReader
from dcp_zarr.store_io.commit import STAGING_DIR, remove_staging_dir
from dcp_zarr.writer import ZarrWriter

__all__ = [
    "WRITTEN_FOR",
    "ZarrFSDPStrategy",
    "ZarrFabricFSDPStrategy",
    "ZarrFabricModelParallelStrategy",
    "ZarrModelParallelStrategy",
]

WRITTEN_FOR = "2.6.6"
_DISTRIBUTION = "lightning"
_ADAPTER = "dcp_zarr.integrations.lightning"
_SAVE = "_distributed_checkpoint_save"
_LOAD = "_distributed_checkpoint_load"
_FSDP1_OPTIMIZER_READER = "torch.distributed.checkpoint.FileSystemReader"
# The checkpoints a strategy remembers having saved, the newest last: where an incremental save looks for its base.
# A few: the newest one is nearly always still there (ModelCheckpoint deletes older ones after saving a newer one).
_REMEMBERED = 8


def _import(module: str) -> ModuleType:
    return import_framework(module, _DISTRIBUTION, WRITTEN_FOR, _ADAPTER)


_trainer_model_parallel = _import("lightning.pytorch.strategies.model_parallel")
_trainer_fsdp = _import("lightning.pytorch.strategies.fsdp")
_fabric_model_parallel = _import("lightning.fabric.strategies.model_parallel")
_fabric_fsdp = _import("lightning.fabric.strategies.fsdp")
_fabric_load = _import("lightning.fabric.utilities.load")  # _METADATA_FILENAME: meta.pt

# The helpers, in the modules whose functions call them (each imported them by name from fabric's fsdp.py).
_HELPERS = [(_trainer_model_parallel, [_SAVE]), (_trainer_fsdp, [_SAVE, _LOAD]),
            (_fabric_model_parallel, [_SAVE, _LOAD]), (_fabric_fsdp, [_SAVE, _LOAD])]
# Lightning's functions on the way from a strategy to a helper: (module, function, the names it must look up when it
# runs, the module whose globals it must look them up in). The Trainer's ModelParallelStrategy loads through fabric's
# _load_checkpoint, which reads fabric's _distributed_checkpoint_load.
_CALLS = [
    (_trainer_model_parallel, "ModelParallelStrategy.save_checkpoint", [_SAVE], _trainer_model_parallel),
    (_trainer_model_parallel, "ModelParallelStrategy.load_checkpoint", ["_load_checkpoint"], _trainer_model_parallel),
    (_trainer_model_parallel, "_load_checkpoint", [_LOAD], _fabric_model_parallel),
    (_fabric_model_parallel, "ModelParallelStrategy.save_checkpoint", ["_save_checkpoint"], _fabric_model_parallel),
    (_fabric_model_parallel, "ModelParallelStrategy.load_checkpoint", ["_load_checkpoint"], _fabric_model_parallel),
    (_fabric_model_parallel, "_save_checkpoint", [_SAVE], _fabric_model_parallel),
    (_fabric_model_parallel, "_load_checkpoint", [_LOAD], _fabric_model_parallel),
    (_trainer_fsdp, "FSDPStrategy.save_checkpoint", [_SAVE], _trainer_fsdp),
    (_trainer_fsdp, "FSDPStrategy.load_checkpoint", [_LOAD, _FSDP1_OPTIMIZER_READER], _trainer_fsdp),
    (_fabric_fsdp, "FSDPStrategy.save_checkpoint", [_SAVE], _fabric_fsdp),
    (_fabric_fsdp, "FSDPStrategy.load_checkpoint", [_LOAD, _FSDP1_OPTIMIZER_READER], _fabric_fsdp),
]


def _names_looked_up(function: Callable) -> set[str]:
    """The globals ``function`` reads as it runs, and ``package.name`` for each ``from package import name`` in it."""
    names, package = set(), ""
    for instruction in dis.get_instructions(inspect.unwrap(function)):
        if instruction.opname == "LOAD_GLOBAL":
            names.add(instruction.argval)
        elif instruction.opname == "IMPORT_NAME":
            package = instruction.argval
        elif instruction.opname == "IMPORT_FROM":
            names.add(f"{package}.{instruction.argval}")
    return names


def _attribute(module: ModuleType, dotted: str) -> Any:
    owner: Any = module
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
    return owner


def _missing_internals() -> Iterator[str]:
    yield from missing_attributes(_fabric_load, ["_METADATA_FILENAME"], _fabric_load.__name__)
    for module, name in ((_trainer_model_parallel, "ModelParallelStrategy"), (_trainer_fsdp, "FSDPStrategy")):
        # ModelCheckpoint's deletions go through remove_checkpoint, and teardown ends fit: both overridden below
        yield from missing_attributes(getattr(module, name, None), ["remove_checkpoint", "teardown"],
                                      f"{module.__name__}.{name}")
    for module, names in _HELPERS:
        yield from missing_attributes(module, names, module.__name__)
        for name in names:
            helper = getattr(module, name, None)
            if helper is not None and len(inspect.signature(helper).parameters) != 2:
                yield f"{module.__name__}.{name}(state, path) (it is now {name}{inspect.signature(helper)})"
    for module, dotted, names, looked_up_in in _CALLS:
        function = _attribute(module, dotted)
        where = f"{module.__name__}.{dotted}"
        if not callable(function):
            yield where
        elif getattr(inspect.unwrap(function), "__globals__", None) is not vars(looked_up_in):
            yield f"{where} running in {looked_up_in.__name__}"
        else:
            yield from (f"{where} calling {name}" for name in names if name not in _names_looked_up(function))


require_internals(_DISTRIBUTION, WRITTEN_FOR, _ADAPTER, _missing_internals())

# Any: attributes of modules found as this module runs, which mypy cannot follow to Lightning's classes.
_TrainerModelParallelStrategy: Any = _trainer_model_parallel.ModelParallelStrategy
_TrainerFSDPStrategy: Any = _trainer_fsdp.FSDPStrategy
_FabricModelParallelStrategy: Any = _fabric_model_parallel.ModelParallelStrategy
_FabricFSDPStrategy: Any = _fabric_fsdp.FSDPStrategy


# --------------------------------------------------------------------------------------------------
# The stand-ins for Lightning's helpers
# --------------------------------------------------------------------------------------------------


@dataclass
class _Routed:
    """What one strategy call sent through dcp_zarr: the proof that Lightning still calls the helpers; and, for a
    save, the strategy's ``compression`` and ``incremental`` for its ``ZarrWriter``, with the checkpoints it saved
    before (its own list, the newest last), where an incremental save finds its base."""

    compression: Compression | None = None
    incremental: bool = False
    saved_before: list[str] = field(default_factory=list)
    saved: list[Path] = field(default_factory=list)
    loaded: list[Path] = field(default_factory=list)


_route: ContextVar[_Routed | None] = ContextVar("dcp_zarr_lightning_route", default=None)


def _save_stand_in(lightning_save: Callable[[dict[str, Any], Path], None]) -> Callable[[dict[str, Any], Path], None]:
    def save(converted_state: dict[str, Any], path: Path) -> None:
        routed = _route.get()
        if routed is None:  # not a save of this module's strategies: another thread's, say
            return lightning_save(converted_state, path)
        # Lightning made ``path`` a directory first; ZarrWriter's commit renames its staging area onto it once the
        # store is complete (an empty directory, or the checkpoint a save to the same path replaces: last.ckpt).
        base = _incremental_base(routed.saved_before, path) if routed.incremental else None
        with _replacing_a_dcp_directory(Path(path)):
            writer = ZarrWriter(path, compression=routed.compression, incremental=routed.incremental,
                                incremental_from=base)
            dcp.save(converted_state, storage_writer=writer, planner=ZarrSavePlanner())
        routed.saved.append(Path(path))

    return save


def _incremental_base(saved_before: list[str], path: str | os.PathLike) -> str | None:
    """The newest of ``saved_before`` (real paths) that is not ``path`` and still holds a committed dcp_zarr store,
    or None (a full save), as rank 0 sees them, on every rank: rank 0 alone deletes checkpoints (ModelCheckpoint's
    removals), and another rank may look before its deletion is done. A collective: every rank saves."""
    target = os.path.realpath(path)
    return decided_by_rank0(lambda: next(
        (earlier for earlier in reversed(saved_before) if earlier != target and _is_complete(earlier)), None))


def _is_complete(location: str) -> bool:
    parent, name = os.path.split(location)
    return os.path.isdir(location) and CheckpointRoot(parent).is_complete(name)


@contextmanager
def _replacing_a_dcp_directory(path: Path) -> Iterator[None]:
    """Let a save replace a checkpoint Lightning's own strategy wrote at ``path``, as that strategy would.

    A job that switched to these strategies and resumed from last.ckpt saves last.ckpt again, where a DCP directory
    (``.metadata``, ``.distcp`` shards, ``meta.pt``) is; ZarrWriter replaces only dcp_zarr stores. Rank 0 moves the
    directory aside before the save (every rank's first collective of it comes after), deletes it once the new store
    is committed, and puts it back if the save fails; a crash in between leaves it at ``.<name>.replaced``."""
    if (dist.is_initialized() and dist.get_rank() != 0) or not is_dcp_directory(path):
        yield
        return
    aside = path.with_name(f".{path.name}.replaced")
    shutil.rmtree(aside, ignore_errors=True)  # left by a crash, before the checkpoint now at ``path`` was saved
    os.rename(path, aside)
    try:
        yield
    except BaseException:
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()  # made again by another rank's mkdir (Lightning makes the path on every rank)
        if not path.exists():
            os.rename(aside, path)
        raise
    shutil.rmtree(aside)


def _load_stand_in(lightning_load: Callable[[dict[str, Any], Path], None]) -> Callable[[dict[str, Any], Path], None]:
    def load(state: dict[str, Any], path: Path) -> None:
        routed = _route.get()
        if routed is None or is_dcp_directory(path):  # written by Lightning's own strategy: read as it would
            return lightning_load(state, path)
        routed.loaded.append(Path(path))  # handed to dcp_zarr: its errors are the ones to show
        refuse_unless_committed(
            path, "dcp_zarr's Lightning strategy (load_checkpoint)",
            f"Pass another ckpt_path (`dcp-zarr list {Path(path).parent}` shows which checkpoints there are complete), "
            "or remove this one")
        # ZarrLoadPlanner: optimizer state in whichever key form it was saved
        dcp.load(state, storage_reader=ZarrReader(path), planner=ZarrLoadPlanner())

    return load


def _reader_stand_in(lightning_reader: Callable[..., Any]) -> Callable[..., Any]:
    """FSDP1's ``load_checkpoint`` reads optimizer state with ``load_sharded_optimizer_state_dict(...,
    storage_reader=FileSystemReader(path=path))``, importing the class from torch.distributed.checkpoint as it runs.
    The stand-in is a function: code elsewhere that asks ``isinstance(x, dcp.FileSystemReader)`` during such a load
    would get a TypeError (torch's own code holds the class under its own name)."""

    def reader(path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        routed = _route.get()
        if routed is None or is_dcp_directory(path):
            return lightning_reader(path, *args, **kwargs)
        routed.loaded.append(Path(path))
        return ZarrReader(path)

    return reader


def _stand_ins() -> list[tuple[Any, str, Any, Any]]:
    """(owner, name, Lightning's object, its stand-in) for every name swapped."""
    swaps: list[tuple[Any, str, Any, Any]] = []
    for module, names in _HELPERS:
        for name in names:
            original = getattr(module, name)
            swaps.append((module, name, original, (_save_stand_in if name == _SAVE else _load_stand_in)(original)))
    swaps.append((dcp, "FileSystemReader", dcp.FileSystemReader, _reader_stand_in(dcp.FileSystemReader)))
    return swaps


_SWAPS = _stand_ins()
# The stand-ins are in place while any of this module's strategies saves or loads, on any thread: counted, so that
# overlapping calls put Lightning's own objects back only when the last one ends.
_swap_lock = threading.Lock()
_calls_in_flight = 0


@contextmanager
def _through_zarr(routed: _Routed | None = None) -> Iterator[_Routed]:
    global _calls_in_flight
    if routed is None:
        routed = _Routed()
    token = _route.set(routed)
    with _swap_lock:
        if _calls_in_flight == 0:
            for owner, name, _, stand_in in _SWAPS:
                setattr(owner, name, stand_in)
        _calls_in_flight += 1
    try:
        yield routed
    finally:
        with _swap_lock:
            _calls_in_flight -= 1
            if _calls_in_flight == 0:
                for owner, name, original, _ in _SWAPS:
                    setattr(owner, name, original)
        _route.reset(token)


def _require_routed(routed: bool, strategy: object, call: str, helper: str, path: Path) -> None:
    require_internals(_DISTRIBUTION, WRITTEN_FOR, _ADAPTER, [] if routed else [
        f"{type(strategy).__name__}.{call} going through {helper}, which this adapter points at dcp_zarr "
        f"({call} at {path} did not call it)"])


@contextmanager
def _saving(strategy: _ZarrStrategy, path: str | os.PathLike) -> Iterator[None]:
    with _through_zarr(_Routed(strategy._zarr_compression, strategy._zarr_incremental,
                               strategy._zarr_saved)) as routed:
        yield
    # A distributed save leaves a directory (a full state dict is one torch.save file, no business of dcp_zarr's).
    _require_routed(bool(routed.saved) or not Path(path).is_dir(), strategy, "save_checkpoint", _SAVE, Path(path))
    for saved in routed.saved:  # remembered once committed, the newest last
        location = os.path.realpath(saved)
        if location in strategy._zarr_saved:
            strategy._zarr_saved.remove(location)
        strategy._zarr_saved.append(location)
    del strategy._zarr_saved[:-_REMEMBERED]


@contextmanager
def _loading(strategy: object, path: str | os.PathLike) -> Iterator[None]:
    path = Path(path)
    # A checkpoint these strategies saved, which Lightning must read through the helper (a store without meta.pt, of
    # a save killed before rank 0 wrote it, is refused by Lightning itself: "does not point to a valid checkpoint").
    saved_here = (path / ROOT_KEY).is_file() and (path / _fabric_load._METADATA_FILENAME).is_file()
    with _through_zarr() as routed:
        try:
            yield
        except BaseException:
            # A store Lightning never handed to dcp_zarr: say why, not what DCP's own reader made of it.
            _require_routed(bool(routed.loaded) or not saved_here, strategy, "load_checkpoint", _LOAD, path)
            raise
    _require_routed(bool(routed.loaded) or not saved_here, strategy, "load_checkpoint", _LOAD, path)


# --------------------------------------------------------------------------------------------------
# ModelCheckpoint's deletions, in the background
# --------------------------------------------------------------------------------------------------


def _removed_in_the_background(strategy: _ZarrStrategy, filepath: str | os.PathLike) -> bool:
    """Whether ``strategy`` took ``filepath``'s removal (module docstring): False where Lightning's own is to run (a
    file, a link, a path that is not a directory here); True on the ranks but 0, which remove nothing."""
    if not getattr(strategy, "is_global_zero", True):
        return True
    _raise_failed_removals(strategy)
    path = os.path.abspath(os.fspath(filepath))
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    parent, name = os.path.split(path)
    removals = strategy._zarr_removals.get(parent)
    if removals is None:  # made before the first rename: a killed job's removals are finished first, not this one's
        root = RootStorage(parent)
        removals = strategy._zarr_removals[parent] = BackgroundDeletions(
            root, finishing_first(root, lambda _, staged: _remove_set_aside(os.path.join(parent, staged))))
    aside = os.path.join(parent, STAGING_DIR, f"{name}{DELETING_MARK}{uuid.uuid4().hex[:12]}")
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    os.rename(path, aside)
    removals.submit(_removal_key(name, removals.pending()), os.path.relpath(aside, parent), lambda: None)
    return True


def _removal_key(name: str, pending: set[int]) -> int:
    """What ``BackgroundDeletions`` knows a removal by, and names in its error: the step of a name Lightning gave
    (``epoch=E-step=N.ckpt``), else (or if a removal of that step is pending) a negative number of its own."""
    step = parse_step(name)
    if step is not None and step not in pending:
        return step
    return min(pending | {0}) - 1


def _remove_set_aside(aside: str) -> None:
    shutil.rmtree(aside)
    remove_staging_dir(aside)  # the staging directory too, once nothing else is in it


def _raise_failed_removals(strategy: _ZarrStrategy) -> None:
    for removals in strategy._zarr_removals.values():
        removals.raise_failure()


@contextmanager
def _joining_removals(strategy: _ZarrStrategy) -> Iterator[None]:
    """Around Lightning's ``teardown``: the removals waited for, then the first that failed raised."""
    try:
        yield
    finally:
        for removals in strategy._zarr_removals.values():
            removals.close()
    _raise_failed_removals(strategy)


# --------------------------------------------------------------------------------------------------
# The strategies
# --------------------------------------------------------------------------------------------------

_PathLike = str | os.PathLike


class _ZarrStrategy:
    """What the four strategies add to Lightning's: ``compression`` and ``incremental``, checked as the strategy is
    built and given to each save's ``ZarrWriter``. First among the bases, so that its ``__init__`` takes them out of
    the arguments before Lightning's sees them."""

    _zarr_compression: Compression | None = None
    _zarr_incremental = False
    _zarr_saved: list[str]  # the real paths of the checkpoints it saved (at most _REMEMBERED), the newest last
    _zarr_removals: dict[str, BackgroundDeletions]  # the Trainer's: ModelCheckpoint's, by directory

    def __init__(self, *args: Any, compression: str | bool | Compression | None = None, incremental: bool = False,
                 **kwargs: Any) -> None:
        self._zarr_compression = compression_choice(compression, type(self).__name__)
        self._zarr_incremental = incremental_choice(incremental, type(self).__name__)
        self._zarr_saved = []
        self._zarr_removals = {}
        super().__init__(*args, **kwargs)


class _RemovedInTheBackground:
    """The Trainer strategies' ``ModelCheckpoint`` removals, in the background (module docstring)."""

    def remove_checkpoint(self, filepath: _PathLike) -> None:
        """Lightning's, for a checkpoint ``ModelCheckpoint`` no longer keeps, but a store is removed in the background
        (renamed aside at once); raises a removal before it that failed."""
        if not _removed_in_the_background(self, filepath):  # type: ignore[arg-type]
            super().remove_checkpoint(filepath)  # type: ignore[misc]

    def teardown(self) -> None:
        """Lightning's, then waits for the removals in the background; raises the first that failed."""
        with _joining_removals(self):  # type: ignore[arg-type]
            super().teardown()  # type: ignore[misc]


class ZarrModelParallelStrategy(_ZarrStrategy, _RemovedInTheBackground, _TrainerModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism applied in ``configure_model``) for the
    ``Trainer``, its distributed checkpoints saved as dcp_zarr stores. Lightning's arguments, ``compression``
    (``ZarrWriter``'s: None, ``"zstd"``, ``"lz4"``, ... or a ``dcp_zarr.Compression``) and ``incremental`` (True:
    each checkpoint reuses the unchanged chunks of the one it saved before; module docstring); with
    ``save_distributed_checkpoint=False`` it saves one ``torch.save`` file, as Lightning does."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PathLike, storage_options: Any = None) -> None:
        with _saving(self, filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: _PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        with _loading(self, checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)


class ZarrFSDPStrategy(_ZarrStrategy, _RemovedInTheBackground, _TrainerFSDPStrategy):
    """Lightning's (FSDP1) ``FSDPStrategy`` for the ``Trainer``, its ``state_dict_type="sharded"`` checkpoints (the
    default here) saved as dcp_zarr stores. Lightning's arguments, ``compression`` (``ZarrWriter``'s) and
    ``incremental``; ``"full"`` saves one ``torch.save`` file, as Lightning does."""

    def __init__(self, *args: Any, state_dict_type: Literal["full", "sharded"] = "sharded",
                 compression: str | bool | Compression | None = None, incremental: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, compression=compression, incremental=incremental,
                         **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PathLike, storage_options: Any = None) -> None:
        with _saving(self, filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: _PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        with _loading(self, checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)


class ZarrFabricModelParallelStrategy(_ZarrStrategy, _FabricModelParallelStrategy):
    """Lightning Fabric's ``ModelParallelStrategy`` (``parallelize_fn(module, device_mesh)``), its distributed
    checkpoints (``fabric.save`` / ``fabric.load``) saved as dcp_zarr stores. Lightning's arguments,
    ``compression`` (``ZarrWriter``'s) and ``incremental``."""

    def save_checkpoint(self, path: _PathLike, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        with _saving(self, path):
            super().save_checkpoint(path, state, storage_options, filter)

    def load_checkpoint(self, path: _PathLike, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        with _loading(self, path):
            return super().load_checkpoint(path, state, strict, weights_only)


class ZarrFabricFSDPStrategy(_ZarrStrategy, _FabricFSDPStrategy):
    """Lightning Fabric's (FSDP1) ``FSDPStrategy``, its ``state_dict_type="sharded"`` checkpoints (the default here)
    saved as dcp_zarr stores. Lightning's arguments, ``compression`` (``ZarrWriter``'s) and ``incremental``;
    ``"full"`` saves one ``torch.save`` file, as Lightning does."""

    def __init__(self, *args: Any, state_dict_type: Literal["full", "sharded"] = "sharded",
                 compression: str | bool | Compression | None = None, incremental: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, compression=compression, incremental=incremental,
                         **kwargs)

    def save_checkpoint(self, path: _PathLike, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        with _saving(self, path):
            super().save_checkpoint(path, state, storage_options, filter)

    def load_checkpoint(self, path: _PathLike, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        with _loading(self, path):
            return super().load_checkpoint(path, state, strict, weights_only)


signature_with_compression(ZarrModelParallelStrategy, _TrainerModelParallelStrategy, incremental=True)
signature_with_compression(ZarrFSDPStrategy, _TrainerFSDPStrategy, incremental=True, state_dict_type="sharded")
signature_with_compression(ZarrFabricModelParallelStrategy, _FabricModelParallelStrategy, incremental=True)
signature_with_compression(ZarrFabricFSDPStrategy, _FabricFSDPStrategy, incremental=True, state_dict_type="sharded")
