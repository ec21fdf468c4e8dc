"""Optimizer key spaces: translate keys between the forms of two optimizer tables (``format/optimizer_tables.py``
finds them: paths, key forms, param tables).

``translate`` pairs a requested table with a saved one (by FQN when both sides know it, else by id after checking
both optimizers hold the same number of params in the same groups) and says, for every requested key, which saved
key feeds it. Everything here is pure: tables and shapes in, key maps out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dcp_zarr.errors import ParamTableMismatchError
from dcp_zarr.format.optimizer_tables import FLATTENED, INT, PARAMS, OptimizerTable, ParamEntry

# -- translation ----------------------------------------------------------------------------------------------------


@dataclass
class Translation:
    """For one requested optimizer: where each of its keys comes from in the checkpoint."""

    sources: dict[str, str] = field(default_factory=dict)  # requested key -> saved key
    keep: set[str] = field(default_factory=set)  # requested keys that keep the requested value (``params`` lists)
    dropped: dict[str, str] = field(default_factory=dict)  # requested key -> why (the param had no state at save)
    missing: dict[str, str] = field(default_factory=dict)  # requested key -> why nothing in the checkpoint feeds it
    owners: dict[str, tuple[str, str]] = field(default_factory=dict)  # requested key -> (requested, saved) param
    # Saved state of params the request holds but asks no state for: a fresh optimizer's state_dict() has none,
    # and DCP would load only the hyperparameters, silently.
    unrequested: list[str] = field(default_factory=list)


def translate(request: OptimizerTable, saved: OptimizerTable) -> Translation:
    """Map every key of the ``request`` optimizer onto the ``saved`` one; refuse tables that do not match."""
    match = _match_params(request, saved)
    out = Translation()
    for r in request.params:
        s = match.get(r)
        if s is not None and s.state_keys and not r.state_keys:
            out.unrequested += [saved.state_key(s, name) for name in s.state_keys]
        for name in r.state_keys:
            key = request.state_key(r, name)
            if s is None:
                out.missing[key] = f"{request.describe(r)} is not in the checkpoint's {saved.summary()}"
            elif not s.state_keys:
                out.dropped[key] = (f"{saved.describe(s)} had no optimizer state when saved (frozen, or never got a "
                                    "gradient)")
            elif name not in s.state_keys:
                out.missing[key] = f"the checkpoint holds {list(s.state_keys)} for {saved.describe(s)}, not {name!r}"
            else:
                out.sources[key] = saved.state_key(s, name)
                out.owners[key] = (request.describe(r), saved.describe(s))
    _translate_groups(request, saved, match, out)
    return out


def _match_params(request: OptimizerTable, saved: OptimizerTable) -> dict[ParamEntry, ParamEntry | None]:
    if request.key_form != INT and saved.key_form != INT:
        by_fqn = {p.fqn: p for p in saved.params}
        return {r: by_fqn.get(r.fqn) for r in request.params}
    # An int id is a position, so it names the same parameter only in an optimizer holding the same parameters in
    # the same groups: anything else would hand one parameter's moments to another.
    problems = []
    if len(request.params) != len(saved.params):
        problems.append("they hold different numbers of params")
    elif request.group_sizes is not None and saved.group_sizes is not None \
            and request.group_sizes != saved.group_sizes:
        problems.append("their param groups hold different numbers of params")
    if any(p.id is None for p in saved.params):
        problems.append("the checkpoint did not record the flattened form's param order")
    if problems:
        raise ParamTableMismatchError(
            f"Optimizer state at {request.name!r} cannot be matched by param id: {'; '.join(problems)}.\n"
            f"  checkpoint: {saved.summary()}\n  requested:  {request.summary()}\n"
            "Param ids are positions across param_groups; they name the same parameters only in optimizers built "
            "over the same parameters in the same order. Build the optimizer as the saving run did, or request "
            "FQN-keyed state (get_optimizer_state_dict) so parameters are matched by name.")
    by_id = {p.id: p for p in saved.params}
    return {r: by_id.get(r.id) for r in request.params}


def _translate_groups(request: OptimizerTable, saved: OptimizerTable, match: dict, out: Translation) -> None:
    if request.key_form == FLATTENED:
        for r in request.params:
            s = match.get(r)
            for name in request.group_keys:
                key = request.group_key(r, name)
                if s is None:
                    out.missing[key] = f"{request.describe(r)} is not in the checkpoint's {saved.summary()}"
                else:
                    out.sources[key] = saved.group_key(s, name)
        return
    group_sizes = request.group_sizes or ()
    for g in range(len(group_sizes)):
        out.keep.add(request.nested_group_key(g, PARAMS))  # the requesting side's own param refs stay
        members = [match.get(r) for r in request.params if r.group == g]
        found = [s for s in members if s is not None]
        if saved.key_form != FLATTENED:
            saved_groups = sorted({s.group for s in found})
            if len(saved_groups) > 1:
                raise ParamTableMismatchError(
                    f"Param group {g} of the requested optimizer {request.name!r} holds parameters that the "
                    f"checkpoint saved in different groups {saved_groups}, so its hyperparameters are ambiguous.\n"
                    f"  checkpoint: {saved.summary()}\n  requested:  {request.summary()}")
        for name in request.group_keys:
            key = request.nested_group_key(g, name)
            if found:
                out.sources[key] = saved.group_key(found[0], name)
            elif saved.group_sizes is not None and len(saved.group_sizes) == len(group_sizes):
                out.sources[key] = saved.nested_group_key(g, name)  # an empty group: same position
            else:
                out.missing[key] = f"no parameter of requested group {g} is in the checkpoint's {saved.summary()}"


def shape_mismatches(translation: Translation, requested_shapes: Mapping[str, tuple | None],
                     saved_shapes: Mapping[str, tuple | None]) -> list[str]:
    """One line per mapped state entry whose requested and saved global shapes differ (tensors only)."""
    lines = []
    for key, source in translation.sources.items():
        want, have = requested_shapes.get(key), saved_shapes.get(source)
        if want is not None and have is not None and tuple(want) != tuple(have):
            mine, theirs = translation.owners.get(key, ("", ""))
            lines.append(f"requested {key!r} ({mine}, shape {list(want)}) <- saved {source!r} ({theirs}, "
                         f"shape {list(have)})")
    return lines
