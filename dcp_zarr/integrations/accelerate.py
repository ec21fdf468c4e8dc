"""Hugging Face accelerate: ``Accelerator.save_state`` / ``load_state`` of an FSDP2 model through dcp_zarr.

    from dcp_zarr.integrations.accelerate import ZarrAccelerator   # was: from accelerate import Accelerator
    accelerator = ZarrAccelerator(...)                              # was: Accelerator(...), same arguments
    accelerator = ZarrAccelerator(..., compression="zstd")          # and the stores' floats compressed

accelerate's ``save_state`` hands an FSDP model and its optimizer to ``save_fsdp_model`` / ``save_fsdp_optimizer``
(``load_state``: ``load_fsdp_model`` / ``load_fsdp_optimizer``), which hard-code DCP's ``FileSystemWriter`` /
``FileSystemReader``. Its save and load pre-hooks run after those calls and are given no FSDP weights, so no hook can
take the FSDP path over. ``ZarrAccelerator.save_state`` / ``load_state`` run accelerate's own methods with those four
names in ``accelerate.accelerator`` pointing, for the length of the call, at functions that build the same state dicts
with accelerate's own helpers and write them with ``ZarrWriter`` + ``ZarrSavePlanner`` (read them with ``ZarrReader``
+ ``ZarrLoadPlanner``) at the same paths: ``checkpoint_N/pytorch_model_fsdp_0``, ``optimizer_0``, ... become zarr
stores, and nothing else accelerate writes, names or resumes from changes. Stores that accelerate itself wrote (a
``.metadata`` file and ``.distcp`` shards) still load, through accelerate's own functions, so a run can switch to
``ZarrAccelerator`` and resume from its last checkpoint.

Written against accelerate 1.16.0 (``WRITTEN_FOR``). The internals relied on are checked when this module is
imported: the four functions with accelerate's parameters, looked up as globals of ``accelerate.accelerator`` by
``save_state`` / ``load_state``, and the fsdp_utils helpers and names they use. If accelerate moved any, the import
raises ``FrameworkVersionError`` naming both versions, rather than a save quietly writing DCP's own files.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import StateDictType

from dcp_zarr.errors import IncompleteCheckpointError, NotACheckpointError
from dcp_zarr.format.compression import Compression
from dcp_zarr.integrations.framework import (
    compression_choice,
    import_framework,
    installed_version,
    missing_attributes,
    refuse_unless_committed,
    require_internals,
    signature_with_compression,
)
from dcp_zarr.lifecycle.folders import FolderState, checkpoint_folders
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.offline import is_dcp_directory
from dcp_zarr.optim.load_planner import ZarrLoadPlanner
from dcp_zarr.planning.save_planner import ZarrSavePlanner
from dcp_zarr.reader import ZarrReader
from dcp_zarr.writer import ZarrWriter

__all__ = ["WRITTEN_FOR", "ZarrAccelerator"]

WRITTEN_FOR = "1.16.0"
_DISTRIBUTION = "accelerate"
_ADAPTER = "dcp_zarr.integrations.accelerate"
# The modules of accelerate this adapter uses, and what it uses of each
_USED = {
    "accelerate.accelerator": ["Accelerator"],
    "accelerate.utils.fsdp_utils": ["_prepare_sd_options", "_get_model_state_dict", "_set_model_state_dict",
                                    "_unwrap_optimizer"],
    "accelerate.utils.constants": ["FSDP_MODEL_NAME", "OPTIMIZER_NAME", "RNG_STATE_NAME"],
}

import_framework(_DISTRIBUTION, _DISTRIBUTION, WRITTEN_FOR, _ADAPTER)


def _import_used() -> tuple[list[Any], list[str]]:
    """The modules of ``_USED`` (None where one cannot be imported) and what of them is missing."""
    modules: list[Any] = []
    missing: list[str] = []
    for name, attributes in _USED.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            module = None
            missing.append(f"module {name}")
        else:
            missing += missing_attributes(module, attributes, name)
        modules.append(module)
    return modules, missing


(_accelerator_module, _fsdp_utils, _constants), _missing = _import_used()
require_internals(_DISTRIBUTION, WRITTEN_FOR, _ADAPTER, _missing)

# Any: accelerate ships no type information, and mypy takes a base class of type Any
_Accelerator: Any = _accelerator_module.Accelerator
_FSDP_MODEL_NAME: str = _constants.FSDP_MODEL_NAME
_OPTIMIZER_NAME: str = _constants.OPTIMIZER_NAME
_RNG_STATE_NAME: str = _constants.RNG_STATE_NAME


# --------------------------------------------------------------------------------------------------
# What save_state / load_state call for an FSDP model, through dcp_zarr
# --------------------------------------------------------------------------------------------------
# Each has accelerate's parameters, names and defaults (checked below), so accelerate's call reaches it unchanged, and
# builds or applies the state dict as accelerate's does, with accelerate's helpers. Anything but a ZarrAccelerator's
# DCP checkpoint (another Accelerator saving in another thread meanwhile, use_dcp=False's per-rank files, a DCP
# directory accelerate wrote itself) goes to accelerate's own function.


def _save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=0, adapter_only=False, use_dcp=True):
    if not _through_zarr(accelerator, use_dcp):
        return _accelerate_functions["save_fsdp_model"](fsdp_plugin, accelerator, model, output_dir, model_index,
                                                        adapter_only, use_dcp)
    options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    state_dict = _fsdp_utils._get_model_state_dict(model, adapter_only=adapter_only, sd_options=options)
    _save({"model": state_dict}, os.path.join(output_dir, f"{_FSDP_MODEL_NAME}_{model_index}"), accelerator)


def _load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, model_index=0, adapter_only=False, use_dcp=True):
    store = _store_in(input_dir, f"{_FSDP_MODEL_NAME}_{model_index}")
    if not _through_zarr(accelerator, use_dcp) or is_dcp_directory(store):
        return _accelerate_functions["load_fsdp_model"](fsdp_plugin, accelerator, model, input_dir, model_index,
                                                        adapter_only, use_dcp)
    options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    state = {"model": _fsdp_utils._get_model_state_dict(model, adapter_only=adapter_only, sd_options=options)}
    _load(state, store)
    return _fsdp_utils._set_model_state_dict(model, state["model"], adapter_only=adapter_only, sd_options=options)


def _save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index=0, use_dcp=True):
    if not _through_zarr(accelerator, use_dcp):
        return _accelerate_functions["save_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, output_dir,
                                                            optimizer_index, use_dcp)
    # Unwrapped, as accelerate does: torch makes a missing state by stepping the optimizer, which must not step
    # accelerate's GradScaler
    plain = _fsdp_utils._unwrap_optimizer(optimizer)
    state = get_optimizer_state_dict(model, plain, options=_fsdp_utils._prepare_sd_options(fsdp_plugin))
    _save({"optimizer": state}, os.path.join(output_dir, f"{_OPTIMIZER_NAME}_{optimizer_index}"), accelerator)


def _load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0,
                         adapter_only=False, use_dcp=True):
    store = _store_in(input_dir, f"{_OPTIMIZER_NAME}_{optimizer_index}")
    if not _through_zarr(accelerator, use_dcp) or is_dcp_directory(store):
        return _accelerate_functions["load_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, input_dir,
                                                            optimizer_index, adapter_only, use_dcp)
    options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    plain = _fsdp_utils._unwrap_optimizer(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, plain, options=options)}
    _load(state, store)
    set_optimizer_state_dict(model, plain, state["optimizer"], options=options)


def _through_zarr(accelerator, use_dcp: bool) -> bool:
    return use_dcp and isinstance(accelerator, ZarrAccelerator)


def _save(state_dict: dict, path: str, accelerator: ZarrAccelerator) -> None:
    writer = ZarrWriter(path, compression=accelerator._zarr_compression)
    dcp.save(state_dict, storage_writer=writer, planner=ZarrSavePlanner())


def _load(state_dict: dict, path: str) -> None:
    folder = Path(path).parent
    refuse_unless_committed(
        path, "ZarrAccelerator.load_state",
        f"load_state({str(folder)!r}) names it: pass a checkpoint_N that `dcp-zarr list {folder.parent}` shows "
        "complete, or call load_state() without a path to resume from the newest complete one")
    # ZarrLoadPlanner: optimizer state in whatever key form it was saved
    dcp.load(state_dict, storage_reader=ZarrReader(path), planner=ZarrLoadPlanner())


def _store_in(input_dir, name: str) -> str:
    """accelerate's rule: a ``load_fsdp_*`` given the store's own directory reads it, any other reads ``name`` in it."""
    return str(input_dir if Path(input_dir).name == name else Path(input_dir) / name)


_ZARR_FUNCTIONS: dict[str, Callable] = {
    "save_fsdp_model": _save_fsdp_model,
    "load_fsdp_model": _load_fsdp_model,
    "save_fsdp_optimizer": _save_fsdp_optimizer,
    "load_fsdp_optimizer": _load_fsdp_optimizer,
}
_CALLERS = {"save_state": ["save_fsdp_model", "save_fsdp_optimizer"],
            "load_state": ["load_fsdp_model", "load_fsdp_optimizer"]}


def _parameters(function: Callable) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def _globals_loaded(function: Callable) -> set[str]:
    """The module globals ``function`` looks up by name when it runs (not attributes: ``fsdp_utils.save_fsdp_model``
    would not see a swap in ``accelerate.accelerator``)."""
    function = inspect.unwrap(function)
    if getattr(function, "__globals__", None) is not vars(_accelerator_module):
        return set()
    return {i.argval for i in dis.get_instructions(function) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}


def _missing_internals() -> list[str]:
    moved = missing_attributes(_accelerator_module, _ZARR_FUNCTIONS, "accelerate.accelerator")
    for method, names in _CALLERS.items():
        caller = getattr(_Accelerator, method, None)
        loaded = _globals_loaded(caller) if callable(caller) else set()
        moved += [f"Accelerator.{method} calling {name} by its name in accelerate.accelerator" for name in names
                  if name not in loaded]
    for name, ours in _ZARR_FUNCTIONS.items():
        theirs = getattr(_accelerator_module, name, None)
        if theirs is not None and _parameters(theirs) != _parameters(ours):
            moved.append(f"accelerate.accelerator.{name}{inspect.signature(ours)} (it is now "
                         f"{name}{inspect.signature(theirs)})")
    return moved


require_internals(_DISTRIBUTION, WRITTEN_FOR, _ADAPTER, _missing_internals())
_accelerate_functions: dict[str, Callable] = {name: getattr(_accelerator_module, name) for name in _ZARR_FUNCTIONS}


# accelerate.accelerator's names point at the functions above while any ZarrAccelerator saves or loads; counted, so
# that overlapping calls on several threads put accelerate's own back only when the last one ends.
_routing_lock = threading.Lock()
_routing_depth = 0


@contextmanager
def _fsdp_checkpoints_through_zarr() -> Iterator[None]:
    global _routing_depth
    with _routing_lock:
        if _routing_depth == 0:
            for name, function in _ZARR_FUNCTIONS.items():
                setattr(_accelerator_module, name, function)
        _routing_depth += 1
    try:
        yield
    finally:
        with _routing_lock:
            _routing_depth -= 1
            if _routing_depth == 0:
                for name, function in _accelerate_functions.items():
                    setattr(_accelerator_module, name, function)


class ZarrAccelerator(_Accelerator):
    """``accelerate.Accelerator`` whose ``save_state`` / ``load_state`` keep an FSDP2 model's and optimizer's sharded
    state in Zarr v3 stores, at accelerate's own paths, loadable at any world size. Same arguments.

    Everything else is accelerate's: ``automatic_checkpoint_naming`` and ``total_limit``, the RNG, scheduler,
    sampler and custom-object files beside the stores; ``load_state()`` picks the highest ``checkpoint_N`` whose
    stores are all committed (accelerate's own picks the highest, even one a killed save left without them). Only FSDP2
    with ``state_dict_type="SHARDED_STATE_DICT"`` goes through DCP, so anything else is refused (``ValueError``)
    before anything is written or read.

    One argument of its own besides accelerate's: ``compression``, passed to each store's ``ZarrWriter`` (None, the
    default: stored as they are; ``"zstd"``, ``"lz4"``, ... or a ``dcp_zarr.Compression``: floating-point arrays
    compressed), checked here rather than at the first save.
    """

    _zarr_compression: Compression | None = None

    def __init__(self, *args: Any, compression: str | bool | Compression | None = None, **kwargs: Any) -> None:
        chosen = compression_choice(compression, type(self).__name__)  # before accelerate sets up its state
        super().__init__(*args, **kwargs)
        self._zarr_compression = chosen

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        self._refuse_unless_fsdp2_sharded("save_state")
        self._refuse_pruning_past_a_partial_checkpoint()
        with _fsdp_checkpoints_through_zarr():
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        self._refuse_unless_fsdp2_sharded("load_state")
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            input_dir = self._latest_complete_checkpoint()
        if input_dir is not None:
            self._warn_without_random_states(input_dir)
        with _fsdp_checkpoints_through_zarr():
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    # -- which checkpoint_N ----------------------------------------------------------------------------------------

    def _checkpoint_folders(self) -> tuple[Path, list[FolderState]]:
        """accelerate's ``checkpoints`` folder and its ``checkpoint_N``, ascending by N, each judged by the stores
        this accelerator writes: a model store per prepared model, an optimizer store per optimizer."""
        folder = Path(self.project_dir) / "checkpoints"
        if not folder.is_dir():  # a CheckpointRoot would make it
            return folder, []
        expected = [f"{_FSDP_MODEL_NAME}_{i}" for i in range(len(self._models))]
        expected += [f"{_OPTIMIZER_NAME}_{i}" for i in range(len(self._optimizers))]
        return folder, checkpoint_folders(CheckpointRoot(str(folder)), expected)

    def _latest_complete_checkpoint(self) -> str:
        """The highest ``checkpoint_N`` whose model and optimizer stores are all committed (or accelerate's own DCP
        directories) and that accelerate finished. accelerate's own choice is the highest N, whatever it holds: a save
        killed before its stores were committed leaves ``checkpoint_N`` without them, and resuming from it would fail.
        Newer ones passed over are named in a warning; with none complete, ``NotACheckpointError`` names what is
        there (``IncompleteCheckpointError`` when saves were interrupted)."""
        folder, folders = self._checkpoint_folders()
        complete = [f for f in folders if f.complete]
        if not complete:
            self._refuse_to_resume_from_nothing(folder, folders)
        latest = complete[-1]
        passed_over = [f for f in folders if f.number > latest.number]
        if passed_over and self.is_main_process:
            warnings.warn(
                f"ZarrAccelerator.load_state: resuming from {folder / latest.name}, not from the newer "
                f"{_described(passed_over)}, {_whose_save(passed_over)} interrupted. Remove "
                f"{'it' if len(passed_over) == 1 else 'them'} before the next save_state() (then set "
                f"accelerator.project_configuration.iteration = {latest.number + 1}): accelerate counts every "
                "checkpoint_N for total_limit and prunes the lowest numbers first, complete or not",
                stacklevel=3)
        return str(folder / latest.name)

    def _refuse_to_resume_from_nothing(self, folder: Path, folders: list[FolderState]) -> NoReturn:
        if not folders:
            raise NotACheckpointError(
                f"ZarrAccelerator.load_state: no checkpoint to resume from: {folder} "
                f"{'holds no checkpoint_N folder' if folder.is_dir() else 'does not exist'} (accelerate's "
                "automatic_checkpoint_naming saves there). Call save_state() first, or pass load_state(input_dir)")
        raise IncompleteCheckpointError(
            f"ZarrAccelerator.load_state: no complete checkpoint to resume from in {folder}: every save there was "
            f"interrupted: {_described(folders)}. Nothing was loaded. Remove "
            f"{'it' if len(folders) == 1 else 'them'} (rm -r {' '.join(str(folder / f.name) for f in folders)}) "
            "and start afresh, saving again; or pass load_state(input_dir) a checkpoint saved elsewhere")

    def _refuse_pruning_past_a_partial_checkpoint(self) -> None:
        """accelerate's ``total_limit`` deletes the lowest-numbered ``checkpoint_N`` first, whatever they hold: with
        an incomplete one above a complete one (a killed save, with the counter set past it), it would delete the
        complete one and keep the other. Refused, before anything is written, on every rank alike."""
        config = self.project_configuration
        if not config.automatic_checkpoint_naming or config.total_limit is None:
            return
        folder, folders = self._checkpoint_folders()
        complete = [f.number for f in folders if f.complete]
        above = [f for f in folders if not f.complete and complete and f.number > min(complete)]
        if above:
            raise ValueError(
                f"ZarrAccelerator.save_state: {folder} holds {_described(above)}, {_whose_save(above)} interrupted, "
                f"above complete checkpoints; with total_limit={config.total_limit} accelerate would count "
                f"{'it' if len(above) == 1 else 'them'} and delete complete checkpoints (lowest numbers first) "
                f"instead. Nothing was saved. Remove {'it' if len(above) == 1 else 'them'} "
                f"(rm -r {' '.join(str(folder / f.name) for f in above)}), set "
                f"accelerator.project_configuration.iteration to the next free number, and save again")

    def _warn_without_random_states(self, input_dir) -> None:
        """accelerate logs "Could not load random states" at INFO, on the main process only, so a rank that finds no
        RNG file (one beyond the saving world size) resumes with its own RNG and step counter unannounced."""
        states = Path(input_dir) / f"{_RNG_STATE_NAME}_{self.process_index}.pkl"
        if not states.parent.is_dir() or states.is_file():
            return
        saved = sorted(path.name for path in states.parent.glob(f"{_RNG_STATE_NAME}_*.pkl"))
        warnings.warn(
            f"ZarrAccelerator.load_state: {states} does not exist ({states.parent} holds "
            f"{', '.join(saved) if saved else 'no random_states_R.pkl'}: it was saved by {len(saved)} process(es)), "
            f"so rank {self.process_index} keeps its own random states and its accelerator.step ({self.step}) "
            "instead of the saved ones; accelerate only logs 'Could not load random states' at INFO on the main "
            "process. Seed this rank (accelerate.utils.set_seed) and set accelerator.step to the saved one (rank 0's) "
            "if the run depends on them", stacklevel=3)

    # -- what this accelerator is ----------------------------------------------------------------------------------

    def _refuse_unless_fsdp2_sharded(self, method: str) -> None:
        plugin = getattr(self.state, "fsdp_plugin", None)
        if plugin is not None and self.is_fsdp2 and plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            return
        found = f"distributed_type={_name(self.distributed_type)}"
        if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            raise ValueError(
                f"ZarrAccelerator.{method}: FSDP was asked for (an fsdp_plugin, or ACCELERATE_USE_FSDP=true) but "
                f"accelerate {installed_version(_DISTRIBUTION)} did not turn it on: accelerator.state has {found} and "
                "fsdp_plugin=None, because AcceleratorState makes a run FSDP only when its processes are on GPU-like "
                "devices (MULTI_GPU, MULTI_XPU, MULTI_NPU, ...), never on CPU (cpu=True, or no GPU found: MULTI_CPU "
                "or NO) nor in a single process (NO). So prepare() did not shard the model and there is no sharded "
                "state to save or load. Launch on GPUs; or, on CPU, right after building the accelerator and before "
                "prepare(), make the three assignments accelerate makes on a GPU: "
                "accelerator.state.distributed_type = DistributedType.FSDP; accelerator.state.fsdp_plugin = "
                "<your FullyShardedDataParallelPlugin>; PartialState._shared_state['distributed_type'] = "
                "DistributedType.FSDP (from accelerate.state import PartialState; from accelerate.utils import "
                "DistributedType; docs/accelerate.md shows them)")
        if plugin is not None:
            found += f", fsdp_version={plugin.fsdp_version}, state_dict_type={_name(plugin.state_dict_type)}"
        raise ValueError(
            f"ZarrAccelerator.{method} keeps FSDP2 models with state_dict_type=SHARDED_STATE_DICT in zarr stores; "
            f"this accelerator has {found}, which accelerate checkpoints in files of its own, not through DCP. Pass "
            "fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type='SHARDED_STATE_DICT'), "
            "or use accelerate.Accelerator for this run")


signature_with_compression(ZarrAccelerator, _Accelerator)


def _described(folders: list[FolderState]) -> str:
    """``checkpoint_12 (optimizer_0 is missing; ...), checkpoint_11 (...)``, newest first."""
    return ", ".join(f"{f.name} ({f.why_incomplete()})" for f in reversed(folders))


def _whose_save(folders: list[FolderState]) -> str:
    return "whose save was" if len(folders) == 1 else "whose saves were"


def _name(member: Any) -> str:
    """An enum member's bare name (``MULTI_CPU``), as a config spells it; Python 3.11 and 3.12 format them apart."""
    return str(getattr(member, "name", member))
