"""torchtitan's checkpoint manager, saving zarr stores: one line of torchtitan's config chooses it.

    checkpoint=ZarrCheckpointManager.Config(enable=True, ...)   # in place of CheckpointManager.Config(...)

``ZarrCheckpointManager`` is torchtitan's ``CheckpointManager`` (when to save, async modes and their staging,
retention, resume, the HF export) with three of its methods overridden, each where torchtitan names the storage:

* ``dcp_save``: a training checkpoint (``step-N``) is a zarr store written by ``ZarrWriter``, planned by
  ``ZarrSavePlanner`` on the group torchtitan saves on, in each async mode; an HF export is torchtitan's own.
* ``dcp_load``: a ``step-N`` store, or ``initial_load_path``, is read by ``ZarrReader``; a DCP directory (it holds
  ``.metadata``: saved before the switch) and HF loads are torchtitan's own. A path without a committed store is
  refused before DCP starts, naming the config line to change.
* ``_find_load_step``: a ``step-N`` folder holding a committed dcp_zarr store counts, besides torchtitan's own.
  torchtitan counts only folders holding DCP's ``.metadata`` or an HF index: without this a resume starts afresh.

Two fields are added to the config, each checked as the config is built (from the command line or a TOML file) and
again as the manager is:

* ``zarr_compression``: a compressor's name (``"zstd"``, ``"lz4"``, ...) that ``ZarrWriter`` compresses the
  floating-point arrays of each ``step-N`` with, or None (the default) for none;
* ``zarr_incremental``: True saves each ``step-N`` incrementally (docs/incremental.md): its unchanged chunks are
  hard links to those of the newest complete ``step-N`` store of the folder (``incremental_from``), rank 0's choice,
  broadcast; the first save, with none there, is a full one that records its chunks. A base is never a store that an
  async save of this manager may still be writing, nor one that torchtitan's ``keep_latest_k`` purge may delete while
  this save reads it (``_incremental_base``); the purge deleting a base later takes nothing from the stores that link
  its chunks. False (the default): full saves.

Written against torchtitan 0.3.0: importing this module checks the internals it relies on (``_missing_internals``)
and raises ``FrameworkVersionError`` naming the installed torchtitan and 0.3.0 when one moved.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from concurrent.futures import Future
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import fsspec.core
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_zarr.errors import CheckpointExistsError
from dcp_zarr.format.compression import COMPRESSORS, Compression
from dcp_zarr.integrations.framework import (
    compression_choice,
    import_framework,
    incremental_choice,
    missing_attributes,
    refuse_unless_committed,
    require_internals,
)
from dcp_zarr.lifecycle.background import BackgroundDeletions, finishing_first
from dcp_zarr.lifecycle.rank0 import decided_by_rank0
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.lifecycle.step_forms import TORCHTITAN
from dcp_zarr.optim.load_planner import ZarrLoadPlanner
from dcp_zarr.planning.save_planner import ZarrSavePlanner
from dcp_zarr.reader import ZarrReader
from dcp_zarr.writer import ZarrWriter

__all__ = ["WRITTEN_FOR", "ZarrCheckpointManager"]

WRITTEN_FOR = "0.3.0"
_ADAPTER = "dcp_zarr.integrations.torchtitan"
_MANAGER_MODULE = "torchtitan.components.checkpointer.dcp"
# torchtitan's own step folders (_create_checkpoint_id), matched whole: not a name that merely contains one.
_STEP_FOLDER = TORCHTITAN.pattern
# The methods overridden below, as torchtitan 0.3.0 declares them: its _save, _load and
# _save_last_step call them with these arguments.
_OVERRIDDEN = {
    "dcp_save": ("self", "state_dict", "checkpoint_id", "async_mode", "enable_garbage_collection", "to_hf"),
    "dcp_load": ("self", "state_dict", "checkpoint_id", "from_hf", "from_quantized"),
    "_find_load_step": ("self", "folder"),
    "_purge_stale_checkpoints": ("self",),
    "_should_purge": ("self",),
    "_close": ("self",),
}
# What CheckpointManager.__init__ sets and the overrides read: the folder, the states (its model wrapper), the
# gloo group of async saves, the pinned-memory stager, how many checkpoints its purge keeps and the queue of its purge
# thread (set where keep_latest_k > 0).
_INSTANCE_ATTRIBUTES = ("folder", "states", "pg", "stager", "keep_latest_k")
# What torchtitan 0.3.0's _purge_stale_checkpoints counts as a checkpoint: every name holding step-<digits> (a
# search, not a match), ordered by that number; it deletes all but the newest keep_latest_k.
_PURGE_COUNTS = re.compile(r"step-(\d+)")


def _missing_internals(manager_module: ModuleType) -> list[str]:
    """The internals of torchtitan 0.3.0 this adapter relies on that ``manager_module`` lacks, one line each."""
    missing = missing_attributes(manager_module, ("CheckpointManager", "AsyncMode", "MODEL", "ModelWrapper",
                                                  "filesystem", "GarbageCollection"), _MANAGER_MODULE)
    if missing:
        return missing
    manager = manager_module.CheckpointManager
    for name, parameters in _OVERRIDDEN.items():
        method = getattr(manager, name, None)
        if method is None:
            missing.append(f"CheckpointManager.{name}")
        elif tuple(inspect.signature(method).parameters) != parameters:
            missing.append(f"CheckpointManager.{name}({', '.join(parameters[1:])}) (it is now "
                           f"{name}{inspect.signature(method)})")
    missing += missing_attributes(manager, ("Config",), "CheckpointManager")
    missing += missing_attributes(manager_module.AsyncMode, ("DISABLED", "ASYNC", "ASYNC_WITH_PINNED_MEM"),
                                  "AsyncMode")
    missing += missing_attributes(manager_module.ModelWrapper, ("load_state_dict",), "ModelWrapper")
    missing += missing_attributes(manager_module.filesystem, ("isdir", "isfile", "listdir", "join"),
                                  "torchtitan.tools.filesystem")
    missing += missing_attributes(manager_module.GarbageCollection, ("collect",), "GarbageCollection")
    return missing


def _import_manager_module() -> ModuleType:
    import_framework("torchtitan", "torchtitan", WRITTEN_FOR, _ADAPTER)  # not installed: FrameworkNotInstalledError
    try:
        module = importlib.import_module(_MANAGER_MODULE)
    except ImportError as exc:  # installed, but the manager is elsewhere now
        require_internals("torchtitan", WRITTEN_FOR, _ADAPTER, [f"module {_MANAGER_MODULE} ({exc})"])
        raise  # unreachable: require_internals raised
    require_internals("torchtitan", WRITTEN_FOR, _ADAPTER, _missing_internals(module))
    return module


_titan = _import_manager_module()
# Any: torchtitan is optional, so its classes are not types to mypy (torchtitan ships no type information either).
_CheckpointManager: Any = _titan.CheckpointManager
_AsyncMode = _titan.AsyncMode
_filesystem = _titan.filesystem


def _fresh(path: str) -> str:
    """``path``, its listings (and its parents') dropped from fsspec's cache where it is a URL. torchtitan's
    ``filesystem`` asks fsspec (s3fs, for ``s3://``), whose cached listings see what fsspec wrote, never what
    ``ZarrWriter`` wrote through obstore: without this, the purge on S3 listed only the steps there when the folder was
    first listed, and deleted none of the later ones."""
    if "://" in str(path):  # torchtitan's own test of a remote path (filesystem.is_remote)
        file_system, inner = fsspec.core.url_to_fs(path)
        file_system.invalidate_cache(inner)
    return path


def _compression(name: Any) -> Compression | None:
    return compression_choice(
        name, "ZarrCheckpointManager", "checkpoint.zarr_compression",
        f"set it to one of the compressors ({', '.join(map(repr, COMPRESSORS))}) or to None (the default: nothing "
        "compressed)")


def _incremental(value: Any) -> bool:
    return incremental_choice(value, "ZarrCheckpointManager", "checkpoint.zarr_incremental")


class ZarrCheckpointManager(_CheckpointManager):
    """torchtitan's ``CheckpointManager``, its checkpoints zarr stores (module docstring; docs/torchtitan.md)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_CheckpointManager.Config):
        # torchtitan's Config.build() constructs the class that declares the Config: declaring it selects this one.
        zarr_compression: str | None = None
        """Compress the floating-point arrays of each checkpoint with this compressor: "zstd" (the smallest
        checkpoints), "lz4" (the fastest), "lz4hc", "blosclz" or "zlib", at level 1; None (the default): stored as
        they are. Arrays under 64 KiB, and those a sample shows do not shrink, are stored as they are."""

        zarr_incremental: bool = False
        """Save each checkpoint incrementally: the chunks unchanged since the newest complete step-N of the folder
        are hard links to its files (a copy on another file system; a server-side copy on an object store), the
        first save in full. Every checkpoint still loads on its own, and keep_latest_k's purge deleting an older
        one takes nothing from the newer ones. False (the default): every checkpoint saved in full."""

        def __post_init__(self) -> None:
            checks = getattr(_CheckpointManager.Config, "__post_init__", None)  # torchtitan's own, async_mode's
            if checks is not None:
                checks(self)  # not super(): slots=True makes the class anew, which a bare super() does not know
            _compression(self.zarr_compression)  # as torchtitan checks async_mode: a bad name fails as it is parsed
            _incremental(self.zarr_incremental)

    # Set by __init__; the class's values serve managers made without it (the tests' bare managers).
    _zarr_compression: Compression | None = None
    _zarr_incremental = False
    # (step folder, the Future of its completion) of this manager's last async save, until it is seen done.
    _zarr_in_flight: tuple[str, Future] | None = None

    def __init__(self, config: Config, **components: Any) -> None:
        # Checked again (the fields may have been set since), before torchtitan's __init__ makes groups and threads.
        compression = _compression(config.zarr_compression)
        incremental = _incremental(config.zarr_incremental)
        super().__init__(config, **components)
        self._zarr_compression, self._zarr_incremental = compression, incremental
        if self.enable:  # a disabled manager sets nothing
            purging = ("purge_queue",) if getattr(self, "keep_latest_k", 0) > 0 else ()
            require_internals("torchtitan", WRITTEN_FOR, _ADAPTER,
                              missing_attributes(self, _INSTANCE_ATTRIBUTES + purging, "CheckpointManager instance"))

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:  # the HF export: safetensors through torchtitan's adapter and writer
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if _filesystem.isfile(_filesystem.join(_fresh(checkpoint_id), ".metadata")):
            raise CheckpointExistsError(
                f"ZarrCheckpointManager.dcp_save: {checkpoint_id} holds a checkpoint torchtitan's own manager saved "
                "(DCP's .metadata and .distcp files), which a zarr store is not saved over: this save was refused "
                f"and nothing was written. Remove it (rm -r {checkpoint_id}) to save this step as a zarr store; "
                "until then a resume loads it as it is, through torchtitan's own reader")
        writer = ZarrWriter(checkpoint_id, compression=self._zarr_compression, incremental=self._zarr_incremental,
                            incremental_from=self._incremental_base(checkpoint_id, async_mode))
        if async_mode == _AsyncMode.DISABLED:
            result = dcp.save(state_dict, storage_writer=writer, planner=ZarrSavePlanner())
        else:
            # self.pg: the gloo group torchtitan gives async saves. The planner must plan on DCP's group; pickled into
            # the pinned-memory mode's background process it plans on that process's default group, DCP's there.
            pinned = async_mode == _AsyncMode.ASYNC_WITH_PINNED_MEM  # torchtitan's stager, DCP's process executor
            result = dcp.async_save(
                state_dict, storage_writer=writer, planner=ZarrSavePlanner(process_group=self.pg),
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS if pinned else AsyncCheckpointerType.THREAD,
                # None in the threaded mode, as torchtitan passes it: DCP then stages with the writer (an AsyncStager)
                async_stager=self.stager if pinned else None)
            # The pinned mode's AsyncSaveResponse: its upload_completion; the threaded mode's Future itself.
            completion: Any = getattr(result, "upload_completion", result)
            self._zarr_in_flight = (checkpoint_id, completion)
        if enable_garbage_collection:
            _titan.GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or _filesystem.isfile(_filesystem.join(_fresh(checkpoint_id), ".metadata")):
            # HF safetensors, or a DCP directory (saved by torchtitan's own manager): torchtitan's own load
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        refuse_unless_committed(checkpoint_id, "ZarrCheckpointManager.dcp_load", self._load_instead(checkpoint_id))
        dcp.load(state_dict, storage_reader=ZarrReader(checkpoint_id), planner=ZarrLoadPlanner())
        # As torchtitan's dcp_load: the model's entries are flattened into state_dict, so its wrapper takes them
        # back (tensors its state_dict hooks made afresh were loaded into copies).
        if _titan.MODEL in self.states:
            self.states[_titan.MODEL].load_state_dict(state_dict)

    def _load_instead(self, checkpoint_id: str) -> str:
        """What to do instead of loading ``checkpoint_id``, which holds no committed store: a ``step-N`` of the
        checkpoint folder is loaded because ``load_step`` names it (a resume takes only committed ones); any other
        path is ``initial_load_path``."""
        folder, name = os.path.split(os.path.abspath(checkpoint_id))
        step = _STEP_FOLDER.match(name)
        if step and folder == os.path.abspath(self.folder):
            return (f"checkpoint.load_step={int(step.group(1))} names it: set load_step to a step that `dcp-zarr list "
                    f"{self.folder}` shows complete, or to -1 (the newest complete one), or remove it "
                    f"(rm -r {checkpoint_id})")
        return ("checkpoint.initial_load_path names it: point it at a committed dcp_zarr store, a DCP directory "
                "(.metadata) or, with checkpoint.initial_load_in_hf, Hugging Face safetensors")

    def _find_load_step(self, folder: str = "") -> int:
        folder = _fresh(folder or self.folder)
        newest = super()._find_load_step(folder)  # DCP and HF checkpoints, torchtitan's way
        if not _filesystem.isdir(folder):
            return newest
        root = CheckpointRoot(folder)
        committed = [int(match.group(1)) for name in _filesystem.listdir(folder)
                     if (match := _STEP_FOLDER.match(name)) and root.is_complete(name)]
        return max([newest, *committed])

    # -- incremental saves ---------------------------------------------------------------------------------------------

    def _incremental_base(self, checkpoint_id: str, async_mode: Any) -> str | None:
        """The store a ``zarr_incremental`` save of ``checkpoint_id`` reuses, the same on every rank: rank 0 chooses
        (``_choose_base``) and broadcasts its choice on the default group, as every rank saves. None: a full save
        (one that records its chunks, when ``zarr_incremental``)."""
        if not self._zarr_incremental:
            return None
        return decided_by_rank0(lambda: self._choose_base(checkpoint_id, async_mode))

    def _choose_base(self, checkpoint_id: str, async_mode: Any) -> str | None:
        """The newest complete ``step-N`` store beside ``checkpoint_id`` (the lifecycle's listing) that this save
        can read from start to end, or None. Not ``checkpoint_id`` itself; not the step an async save of this
        manager may still be writing (torchtitan waits for one before the next save, but a caller of dcp_save may
        not); and, when ``keep_latest_k`` purges, only among the step folders torchtitan's purge keeps, as that
        purge runs on rank 0 while this save may be reading: the newest ``keep_latest_k`` of those there now, this
        save's own counted too where it appears before it is complete (an async save to storage written in place:
        the purge runs as soon as dcp_save returns)."""
        folder, name = os.path.split(os.fspath(checkpoint_id).rstrip("/"))
        if not _filesystem.isdir(_fresh(folder)):
            return None
        root = CheckpointRoot(folder)
        busy = {name}
        if self._zarr_in_flight is not None:
            writing, completion = self._zarr_in_flight
            if completion.done():
                self._zarr_in_flight = None
            else:
                busy.add(os.path.basename(os.fspath(writing).rstrip("/")))
        candidates = [s for s in root.step_stores()
                      if s.complete and s.name not in busy and TORCHTITAN.step(s.name) is not None]
        keep = self.keep_latest_k
        if keep > 0:
            names = root.names()
            if async_mode != _AsyncMode.DISABLED and not root.storage.commits_by_rename and name not in names:
                names.append(name)
            counted = sorted((int(found.group(1)), n) for n in names if (found := _PURGE_COUNTS.search(n)))
            kept = {n for _, n in counted[-keep:]}
            candidates = [s for s in candidates if s.name in kept]
        return root.location(candidates[-1].name) if candidates else None

    # -- retention -----------------------------------------------------------------------------------------------------

    # Rank 0's, made by its first purge: keep_latest_k's deletions of step-N folders, one at a time, in order.
    _zarr_deletions: BackgroundDeletions | None = None

    def _purge_stale_checkpoints(self) -> None:
        """torchtitan's ``keep_latest_k`` purge (the same folders, counted its way), each ``step-N`` deleted by
        dcp_zarr so that no crash leaves it looking complete: renamed aside then removed on a file system, its commit
        marks first after a ``deleting`` record on an object store. On a thread of its own, as torchtitan's purge;
        before its first deletion it finishes those a killed process left. A deletion that failed is raised at
        rank 0's next purge (after the next save) or by ``close()``. A name that merely holds ``step-N`` (which
        torchtitan counts too) goes to torchtitan's own purge thread."""
        _fresh(self.folder)  # torchtitan's _should_purge asks whether it is a directory
        if not self._should_purge():
            return
        if self._zarr_deletions is None:
            root = CheckpointRoot(self.folder)
            self._zarr_deletions = BackgroundDeletions(root, finishing_first(root, root.delete_step))
        self._zarr_deletions.raise_failure()
        counted = sorted((int(found.group(1)), name) for name in _filesystem.listdir(self.folder)
                         if (found := _PURGE_COUNTS.search(name)))
        for step, name in counted[:-self.keep_latest_k]:
            if TORCHTITAN.step(name) == step:
                self._zarr_deletions.submit(step, name, lambda: None)
            else:
                self.purge_queue.put(_filesystem.join(self.folder, name))

    def _close(self) -> Any:
        deletions, self._zarr_deletions = self._zarr_deletions, None
        try:
            result = super()._close()  # torchtitan's purge thread joined, its stager closed
        finally:
            if deletions is not None:
                deletions.close()
        if deletions is not None:
            deletions.raise_failure()
        return result

