"""Names that drift: module wrappers insert components into parameter names, and a checkpoint stops matching.

``torch.compile(model)`` names everything ``_orig_mod.<name>``; activation checkpointing
(``checkpoint_wrapper``) turns ``layers.0.attn.w`` into ``layers.0._checkpoint_wrapped_module.attn.w``; FSDP1
adds ``_fsdp_wrapped_module.``. A checkpoint saved from ``model.state_dict()`` with one set of wrappers then fails to
load into the same model with another ("Missing key in checkpoint state_dict", torchtitan #961).
(``get_state_dict`` already strips these; raw ``state_dict()`` does not.)

Three ways to deal with it, from least to most automatic:

* ``explain_missing_name`` / ``WrapperPrefixError``: an error that names the wrapper, instead of a bare missing key;
* ``strip_wrapper_prefixes(state_dict)``: canonical names before saving (the tensors themselves are shared);
* ``PrefixTolerantLoadPlanner`` (or ``WrapperPrefixLoadMixin`` on your own DefaultLoadPlanner subclass): loads
  entries whose names differ only by wrapper components, in either direction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

# The name logic is torch-free (wrapper_names.py); it is re-exported here, where the planners that use it live.
from dcp_zarr.optim.wrapper_names import (  # noqa: F401
    WRAPPER_COMPONENTS,
    WrapperPrefixError,
    canonical_name,
    describe_renames,
    explain_missing_name,
    strip_wrapper_prefixes,
    wrapper_renames,
    wrappers_in,
)
from dcp_zarr.torch_private import flatten_state_dict, set_element

if TYPE_CHECKING:  # what the mixin is mixed into, so mypy checks its super() calls; at run time a plain mixin
    _PlannerBase = DefaultLoadPlanner
else:
    _PlannerBase = object


class WrapperPrefixLoadMixin(_PlannerBase):
    """For ``DefaultLoadPlanner`` subclasses (``ZarrLoadPlanner`` included): match state-dict names to checkpoint
    names that differ only by wrapper components (``_orig_mod.``, ``_checkpoint_wrapped_module.``), either way.

    Put it first: ``class MyPlanner(WrapperPrefixLoadMixin, ZarrLoadPlanner)``. The renaming happens before the
    planner below sees the state dict, so its own key checks see checkpoint names. ``rename_wrapped=False`` raises
    ``WrapperPrefixError`` naming the wrapper instead of loading anything.
    """

    def __init__(self, *args, rename_wrapped: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.rename_wrapped = rename_wrapped
        self.wrapper_renames: dict[str, str] = {}
        self._caller_paths: dict[str, tuple] = {}
        self._caller_state_dict: dict | None = None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.wrapper_renames, self._caller_paths, self._caller_state_dict = {}, {}, None
        if metadata is not None:
            flat, paths = flatten_state_dict(state_dict)
            renames = wrapper_renames(flat.keys(), metadata.state_dict_metadata.keys())
            if renames and not self.rename_wrapped:
                raise WrapperPrefixError(
                    f"state-dict keys are missing from the checkpoint because {describe_renames(renames)}. Load "
                    "with dcp_zarr.PrefixTolerantLoadPlanner() (or rename_wrapped=True), or save with "
                    "strip_wrapper_prefixes()")
            if renames and not getattr(self, "flatten_state_dict", True):
                raise WrapperPrefixError(
                    "renaming wrapped keys needs flatten_state_dict=True (the default): " + describe_renames(renames))
            if renames:
                saved_paths = metadata.planner_data or {}
                moves = {paths[name]: tuple(saved_paths.get(saved, _canonical_path(paths[name])))
                         for name, saved in renames.items()}
                self.wrapper_renames = renames
                self._caller_state_dict = state_dict
                self._caller_paths = {renames.get(name, name): path for name, path in paths.items()}
                state_dict = _moved_copy(state_dict, moves)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item, value) -> None:
        super().load_bytes(read_item, value)
        if self._caller_state_dict is None:
            return
        # Tensors load in place into the caller's own tensors, but a non-tensor value is *replaced*, and only in
        # the renamed copy of the containers: put it back into the caller's state dict, under the caller's name.
        fqn = read_item.dest_index.fqn
        loaded = _get_path(self.original_state_dict, self.mappings[fqn])
        set_element(self._caller_state_dict, self._caller_paths[fqn], loaded)


class PrefixTolerantLoadPlanner(WrapperPrefixLoadMixin, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads across ``torch.compile`` / activation-checkpoint name changes."""


def _canonical_path(path: tuple) -> tuple:
    return tuple(canonical_name(p) if isinstance(p, str) else p for p in path)


def _moved_copy(state_dict, moves: dict[tuple, tuple]):
    """A copy of the nested containers of ``state_dict`` (leaves shared) with each old path renamed to its new one.

    Renaming happens on the dict key that differs, so a whole subtree (all the optimizer state of one parameter)
    moves at once and list positions are never disturbed.
    """
    copy = _copy_containers(state_dict)
    for old, new in moves.items():
        if len(old) != len(new):
            raise WrapperPrefixError(f"cannot rename {old} to the checkpoint's {new}: they are nested differently")
        for i, (a, b) in enumerate(zip(old, new)):
            parent = _get_path(copy, new[:i])
            if a != b and isinstance(parent, dict) and a in parent:
                parent[b] = parent.pop(a)
    return copy


def _copy_containers(value):
    if isinstance(value, Mapping):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    return value


def _get_path(root, path):
    node = root
    for key in path:
        node = node[key]
    return node
