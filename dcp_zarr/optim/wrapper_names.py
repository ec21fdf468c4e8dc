"""Names that drift, as names only (no torch): which components module wrappers insert, a name without them, and the
error or hint when a name is missing only because of them. ``prefixes.py`` builds the load planners on this; the
offline reader uses it for its "no such entry" hints without importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dcp_zarr.errors import WrapperPrefixError

# Name component -> what inserted it. Only components no real module attribute would carry: a bare "module."
# (DDP) is left alone because a model may well have a submodule called "module".
WRAPPER_COMPONENTS = {
    "_orig_mod": "torch.compile",
    "_checkpoint_wrapped_module": "activation checkpointing (checkpoint_wrapper)",
    "_fsdp_wrapped_module": "FSDP1 (FullyShardedDataParallel)",
}




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


def explain_missing_name(
    name: str, checkpoint_names: Iterable[str], subject: str = "the requested names"
) -> str | None:
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
