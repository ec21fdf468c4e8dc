"""``ZarrLoadPlanner``: DCP's DefaultLoadPlanner, plus optimizer key translation and missing-key errors that help.

DCP matches requested keys to saved keys literally, so optimizer state saved under FQNs cannot load into
``optimizer.state_dict()``'s integer ids ("Missing key in checkpoint state_dict: optimizer.state.0.step"). This
planner reads the checkpoint's optimizer param tables (manifest "optimizers", see optim/keys.py) and gives each
read item ``dest_index`` = the requested key and ``storage_index`` = the saved key that holds the same parameter's
state. The reader needs nothing new: it reads ``storage_index`` and the planner resolves ``dest_index``.

Everything is decided in ``set_up_planner``, before DCP plans anything, on every rank alike (same request, same
manifest), so an error is raised on every rank and no rank waits in a collective for another.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import logging
from collections.abc import Mapping

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from dcp_zarr.errors import MissingKeysError, ParamTableMismatchError
from dcp_zarr.format.manifest import Manifest
from dcp_zarr.format.optimizer_tables import OptimizerTable, find_optimizers, tables_of_manifest
from dcp_zarr.gc_pause import step_with_collector_paused
from dcp_zarr.loading.metadata import MANIFEST_IN_STORAGE_DATA
from dcp_zarr.optim.keys import Translation, shape_mismatches, translate
from dcp_zarr.planning.load_plan import read_items_of

logger = logging.getLogger(__name__)

_LISTED = 8  # missing keys listed in an error before "... and N more"


class ZarrLoadPlanner(DefaultLoadPlanner):
    """Load any optimizer key form (FQN, int id, flattened) from any saved form, through the saved param tables.

    Parameters are matched by FQN when both sides know it, else by id (position across param_groups) after
    checking both optimizers hold the same number of params in the same groups; every mapped tensor's shape is
    checked. ``param_groups[g]["params"]`` keeps the requesting side's own refs.

    Requested state for a parameter that had no optimizer state at save (frozen, or never got a gradient) is
    removed from the state dict being loaded, so the optimizer ends up as it was saved; see ``skipped``.
    Any other requested key without a saved counterpart raises ``MissingKeysError`` (listing them, the nearest
    saved keys, both sides' key forms and state_dict_type), unless ``allow_partial_load=True``, which loads the
    rest, leaves those keys as requested, and lists them in ``skipped``.

    Attributes (after ``dcp.load``):
        skipped: requested key -> why it was not loaded.
        translated: requested key -> the saved key it was loaded from, where the two differ.
        unrequested: saved state keys of parameters the request holds but asks no state for (a fresh optimizer's
            ``state_dict()``): not loaded, and logged as a warning.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict, flatten_sharded_tensors, allow_partial_load)
        self.skipped: dict[str, str] = {}
        self.translated: dict[str, str] = {}
        self.unrequested: list[str] = []
        self._sources: dict[str, str | None] = {}  # requested key -> saved key; None: keep the requested value

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            raise ValueError("ZarrLoadPlanner needs the checkpoint's metadata")
        self.skipped, self.translated, self.unrequested = {}, {}, []
        paths = self.mappings if self.flatten_state_dict else {key: (key,) for key in self.state_dict}
        manifest = _manifest_of(metadata)
        saved_tables = tables_of_manifest(manifest) if manifest is not None else []
        requested_tables = find_optimizers(paths, lambda key: self.state_dict.get(key))
        translations = self._translate(requested_tables, saved_tables, metadata)
        sources: dict[str, str | None] = {}
        dropped: dict[str, str] = {}
        floors: dict[str, int] = {}
        missing: dict[str, str] = {}
        for table, translation in translations:
            sources.update(translation.sources)
            sources.update({key: None for key in translation.keep})
            dropped.update(translation.dropped)
            floors.update({key: len(table.path) + 2 for key in translation.dropped})
            missing.update(translation.missing)
            self.unrequested += translation.unrequested
        for key in self.state_dict:
            source = sources.setdefault(key, key)
            if key in dropped or key in missing or source is None:
                continue
            if source not in metadata.state_dict_metadata:
                missing[key] = "not in the checkpoint" if source == key else f"its saved form {source!r} is missing"
        dropped = {key: why for key, why in dropped.items() if key in self.state_dict}
        missing = {key: why for key, why in missing.items() if key in self.state_dict}
        if missing and not self.allow_partial_load:
            raise MissingKeysError(_missing_message(missing, metadata, manifest, requested_tables, saved_tables,
                                                    self.state_dict))
        self._drop({key: floors[key] for key in dropped})
        for key, why in missing.items():
            self.skipped[key] = f"{why} (allow_partial_load=True: kept its requested value)"
        for key, why in dropped.items():
            self.skipped[key] = f"{why}: removed from the loaded state dict"
        self._sources = {key: sources[key] for key in self.state_dict if key not in missing}
        self.translated = {key: src for key, src in self._sources.items() if src is not None and src != key}
        if self.skipped and is_coordinator:
            logger.warning("dcp_zarr: %d requested keys were not loaded: %s", len(self.skipped),
                           "; ".join(f"{k}: {v}" for k, v in list(self.skipped.items())[:_LISTED]))
        if self.unrequested and is_coordinator:
            logger.warning("dcp_zarr: the checkpoint has optimizer state the request does not ask for (%d entries, "
                           "e.g. %s), so it is not loaded. A fresh optimizer's state_dict() has no state: prime it "
                           "(one step at lr=0) before dcp.load.", len(self.unrequested),
                           ", ".join(self.unrequested[:3]))

    def stored_key(self, key: str) -> str | None:
        """The saved key that ``key`` of the state dict loads from (after translation), or None when it is not
        loaded: what ZarrReader's shared reads ask of a key this rank has no read item for (an empty box)."""
        return self._sources.get(key)

    @step_with_collector_paused
    def create_local_plan(self) -> LoadPlan:
        metadata = self.metadata
        assert metadata is not None  # set_up_planner refuses to plan without it
        items: list[ReadItem] = []
        meshes: dict = {}
        for key, obj in self.state_dict.items():
            source = self._sources.get(key)
            if source is None:
                continue
            for item in read_items_of(source, obj, metadata, True, meshes):
                if source != key:
                    item = dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index, fqn=key))
                items.append(item)
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=False)  # as DefaultLoadPlanner; ZarrReader builds it from JSON
        key = read_item.dest_index.fqn
        if not self.flatten_state_dict:
            self.state_dict[key] = loaded
            return
        # DCP's set_element would write state[0] of an int-keyed optimizer state as state["0"]: follow real keys.
        *parents, last = self.mappings[key]
        container = self.original_state_dict
        for part in parents:
            container = container[_real_key(container, part)]
        container[_real_key(container, last)] = loaded

    # -- helpers -----------------------------------------------------------------------------------------------------

    def _translate(self, requested: list[OptimizerTable], saved: list[OptimizerTable],
                   metadata: Metadata) -> list[tuple[OptimizerTable, Translation]]:
        saved_by_path = {table.path: table for table in saved}
        translations = []
        for table in requested:
            counterpart = saved_by_path.get(table.path)
            if counterpart is None:
                continue  # nothing recorded there: literal key matching, and a clear error if that fails
            translations.append((table, _translate_checked(table, counterpart, self.state_dict, metadata)))
        return translations

    def _drop(self, dropped: Mapping[str, int]) -> None:
        """Remove requested state of params that had none at save, from the caller's nested state dict too.

        ``dropped`` maps each key to the depth of its param's state dict (``state[ref]``, len(prefix) + 2): that
        dict goes once it is empty, ``state`` itself stays. Keys in the flattened form are single entries.
        """
        for key, floor in dropped.items():
            self.state_dict.pop(key, None)
            path = self.mappings.pop(key, None) if self.flatten_state_dict else None
            if path is None:
                continue
            containers = [self.original_state_dict]
            for part in path[:-1]:
                containers.append(containers[-1][_real_key(containers[-1], part)])
            del containers[-1][_real_key(containers[-1], path[-1])]
            for depth in range(len(path) - 1, floor - 1, -1):
                if containers[depth]:
                    break
                del containers[depth - 1][_real_key(containers[depth - 1], path[depth - 1])]


def _translate_checked(request: OptimizerTable, saved: OptimizerTable, state_dict: dict,
                       metadata: Metadata) -> Translation:
    translation = translate(request, saved)
    requested_shapes = {key: _global_shape(state_dict.get(key)) for key in translation.sources}
    saved_shapes = {}
    for source in translation.sources.values():
        md = metadata.state_dict_metadata.get(source)
        saved_shapes[source] = tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
    mismatches = shape_mismatches(translation, requested_shapes, saved_shapes)
    if mismatches:
        raise ParamTableMismatchError(
            f"Optimizer state at {request.name!r} does not fit the checkpoint's: {len(mismatches)} entries have "
            "different shapes, so the parameters do not correspond:\n  " + "\n  ".join(mismatches[:_LISTED])
            + (f"\n  ... and {len(mismatches) - _LISTED} more" if len(mismatches) > _LISTED else "")
            + f"\n  checkpoint: {saved.summary()}\n  requested:  {request.summary()}")
    return translation


def _global_shape(value) -> tuple | None:
    # DTensor and ShardedTensor are Tensors whose size() is the global shape.
    return tuple(value.size()) if isinstance(value, torch.Tensor) else None


def _real_key(container, part):
    """The container's own key for a path component: DCP paths spell every dict key as str."""
    if isinstance(container, Mapping) and part not in container:
        for key in container:
            if str(key) == part:
                return key
    return part


def _manifest_of(metadata: Metadata) -> Manifest | None:
    extra = metadata.storage_data
    if isinstance(extra, dict) and isinstance(extra.get(MANIFEST_IN_STORAGE_DATA), Manifest):
        return extra[MANIFEST_IN_STORAGE_DATA]
    return None


def _request_type(state_dict: dict) -> str:
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(v, DTensor) or type(v).__name__ == "ShardedTensor" for v in state_dict.values())
    return "sharded" if sharded else "full"


def _missing_message(missing: dict[str, str], metadata: Metadata, manifest: Manifest | None,
                     requested: list[OptimizerTable], saved: list[OptimizerTable], state_dict: dict) -> str:
    saved_keys = list(metadata.state_dict_metadata)
    lines = [f"Missing key in checkpoint state_dict: {len(missing)} of {len(state_dict)} requested keys have no "
             "counterpart in the checkpoint:"]
    for key, why in list(missing.items())[:_LISTED]:
        near = difflib.get_close_matches(key, saved_keys, n=3, cutoff=0.5)
        lines.append(f"  {key}: {why}" + (f"; nearest saved: {', '.join(near)}" if near else ""))
    if len(missing) > _LISTED:
        lines.append(f"  ... and {len(missing) - _LISTED} more")
    saved_type = manifest.state_dict_type if manifest else "unknown (no dcp_zarr manifest)"
    world = f", saved world size {manifest.saved_world_size}" if manifest else ""
    lines.append(f"Checkpoint: state_dict_type {saved_type}{world}; "
                 + (", ".join(t.summary() for t in saved) if saved else "no optimizer param table recorded"))
    lines.append(f"Requested:  state_dict_type {_request_type(state_dict)}; "
                 + (", ".join(t.summary() for t in requested) if requested else "no optimizer state dict found"))
    paired = {t.path for t in saved} & {t.path for t in requested}
    if requested and saved and not paired:
        lines.append("The requested optimizer state sits at a different path than the saved one: request it "
                     f"under {[t.name for t in saved]} (the names used at save).")
    lines.append("Fix: load with planner=ZarrLoadPlanner() (it translates FQN, int-id and flattened optimizer keys "
                 "through the saved param tables); if these keys are new, or belong to parameters you mean to start "
                 "fresh, pass ZarrLoadPlanner(allow_partial_load=True) to load the rest and keep their current "
                 "values (planner.skipped lists them).")
    return "\n".join(lines)
