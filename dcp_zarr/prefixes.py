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

from collections.abc import Iterable, Mapping

from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dcp_zarr.errors import ZarrCheckpointError

# Name component -> what inserted it. Only components no real module attribute would carry: a bare "module."
# (DDP) is left alone because a model may well have a submodule called "module".
WRAPPER_COMPONENTS = {
    "_orig_mod": "torch.compile",
    "_checkpoint_wrapped_module": "activation checkpointing (checkpoint_wrapper)",
    "_fsdp_wrapped_module": "FSDP1 (FullyShardedDataParallel)",
}


class WrapperPrefixError(ZarrCheckpointError, RuntimeError):
    """State-dict names and checkpoint names differ only by module-wrapper components."""


def canonical_name(name: str) -> str:
    """``name`` without wrapper components: ``_orig_mod.layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def wrappers_in(name: str) -> list[str]:
    return [part for part in name.split(".") if part in WRAPPER_COMPONENTS]


def wrapper_renames(names: Iterable[str], checkpoint_names: Iterable[str]) -> dict[str, str]:
    """``{name: checkpoint_name}`` for every name absent from the checkpoint whose canonical form matches exactly one
    checkpoint name. Raises ``WrapperPrefixError`` when a match is ambiguous or two names would share one entry."""
    available = set(checkpoint_names)
    by_canonical: dict[str, list[str]] = {}
    for saved in available:
        by_canonical.setdefault(canonical_name(saved), []).append(saved)
    renames: dict[str, str] = {}
    claimed: dict[str, str] = {}
    names = list(names)
    present = set(names) & available
    for name in names:
        if name in available:
            continue
        candidates = by_canonical.get(canonical_name(name), [])
        if len(candidates) > 1:
            raise WrapperPrefixError(
                f"{name!r} is not in the checkpoint, and without wrapper prefixes it matches several entries: "
                f"{sorted(candidates)}")
        if not candidates:
            continue
        target = candidates[0]
        if target in present or target in claimed:
            raise WrapperPrefixError(
                f"{name!r} and {claimed.get(target, target)!r} would both load checkpoint entry {target!r}")
        claimed[target] = name
        renames[name] = target
    return renames


def describe_renames(renames: Mapping[str, str], limit: int = 3, subject: str = "the state dict's names") -> str:
    """One sentence naming the wrappers behind ``renames`` and a few examples."""
    inserted: dict[str, None] = {}
    removed: dict[str, None] = {}
    for name, saved in renames.items():
        for part in wrappers_in(name):
            if part not in wrappers_in(saved):
                inserted[part] = None
        for part in wrappers_in(saved):
            if part not in wrappers_in(name):
                removed[part] = None
    parts = []
    if inserted:
        parts.append(f"{subject} carry " + ", ".join(
            f"'{w}.' (added by {WRAPPER_COMPONENTS[w]})" for w in inserted) + ", the checkpoint's names do not")
    if removed:
        parts.append("the checkpoint's names carry " + ", ".join(
            f"'{w}.' (added by {WRAPPER_COMPONENTS[w]})" for w in removed) + f", {subject} do not")
    examples = ", ".join(f"{a!r} -> {b!r}" for a, b in list(renames.items())[:limit])
    more = f" (and {len(renames) - limit} more)" if len(renames) > limit else ""
    return f"{'; '.join(parts) or 'names differ by wrapper components'}: {examples}{more}"


def explain_missing_name(name: str, checkpoint_names: Iterable[str], subject: str = "the requested names") -> str | None:
    """A hint when ``name`` is missing only because of wrapper components; None when that is not why."""
    try:
        renames = wrapper_renames([name], checkpoint_names)
    except WrapperPrefixError as exc:
        return str(exc)
    if not renames:
        return None
    return describe_renames(renames, subject=subject)


def strip_wrapper_prefixes(state_dict):
    """A copy of a (nested) state dict with wrapper components removed from every key; values are not copied.

    Use it before saving (``dcp.save({"model": strip_wrapper_prefixes(model.state_dict())}, ...)``) so the
    checkpoint's names do not depend on how the model happened to be wrapped.
    """
    if not isinstance(state_dict, Mapping):
        return state_dict
    result = {}
    for key, value in state_dict.items():
        new_key = canonical_name(key) if isinstance(key, str) else key
        if new_key in result:
            raise WrapperPrefixError(f"keys {key!r} and another both become {new_key!r} without wrapper prefixes")
        result[new_key] = strip_wrapper_prefixes(value)
    return result


class WrapperPrefixLoadMixin:
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
        self._caller_state_dict = None

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
