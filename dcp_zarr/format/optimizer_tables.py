"""Optimizer tables: the part of the manifest that records each optimizer's state dict (its path, key form and
param table: id, FQN, group, the state names it holds), and how they are found in a state dict's keys.

One optimizer's state can be keyed three ways, and DCP matches keys only literally:

* ``"fqn"``: ``get_optimizer_state_dict`` / ``get_state_dict``: ``state[fqn][name]``, ``param_groups[g]["params"]``
  lists FQNs;
* ``"int"``: ``optimizer.state_dict()``: ``state[id][name]`` where ``id`` is the parameter's position across
  ``param_groups`` (how torch.optim numbers them); ``params`` lists those ids;
* ``"flattened"``: ``flatten_optimizer_state_dict=True``: ``state.{fqn}.{name}`` and ``param_groups.{fqn}.{k}``
  as single keys; the group structure is not kept.

Pure: paths and values in, tables out. ``optim/keys.py`` translates keys between two tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.format.values import decode_value

FQN = "fqn"
INT = "int"
FLATTENED = "flattened"
KEY_FORMS = (FQN, INT, FLATTENED)

STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"


@dataclass(frozen=True)
class ParamEntry:
    """One parameter of an optimizer: its id (position across param_groups), FQN, group, and state names."""

    id: int | None
    fqn: str | None
    group: int | None
    state_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class OptimizerTable:
    """One optimizer's state dict, located in a (saved or requested) state dict."""

    path: tuple[str | int, ...]
    key_form: str
    params: tuple[ParamEntry, ...]
    group_sizes: tuple[int, ...] | None  # None in the flattened form, which does not keep groups
    group_keys: tuple[str, ...] = ()  # hyperparameter names (``params`` excluded)

    @property
    def name(self) -> str:
        return ".".join(map(str, self.path)) or "<root>"

    def _key(self, *parts: str | int) -> str:
        # DCP's flat key: the path joined with dots. The nested and the flattened forms give the same string for
        # the same state entry, so ``state.{ref}.{name}`` serves both.
        return ".".join(map(str, (*self.path, *parts)))

    def ref(self, param: ParamEntry) -> str:
        """How ``param`` is named under ``state`` in this form."""
        return str(param.id) if self.key_form == INT else str(param.fqn)

    def state_key(self, param: ParamEntry, name: str) -> str:
        return self._key(STATE, self.ref(param), name)

    def group_key(self, param: ParamEntry, name: str) -> str:
        if self.key_form == FLATTENED:
            return self._key(f"{PARAM_GROUPS}.{param.fqn}.{name}")
        # str(): a nested table's params all have a group; a malformed manifest's None names no key (reported missing)
        return self._key(PARAM_GROUPS, str(param.group), name)

    def nested_group_key(self, group: int, name: str) -> str:
        return self._key(PARAM_GROUPS, group, name)

    def describe(self, param: ParamEntry) -> str:
        parts = [f"param id {param.id}" if param.id is not None else "param"]
        if param.fqn is not None:
            parts.append(repr(param.fqn))
        if param.group is not None:
            parts.append(f"(group {param.group})")
        return " ".join(parts)

    def summary(self) -> str:
        groups = f"groups of {list(self.group_sizes)}" if self.group_sizes is not None else "groups not recorded"
        return f"optimizer {self.name!r} in {self.key_form} form: {len(self.params)} params, {groups}"

    def to_json(self) -> dict:
        return {
            "path": list(self.path),
            "key_form": self.key_form,
            "num_params": len(self.params),
            "group_sizes": list(self.group_sizes) if self.group_sizes is not None else None,
            "group_keys": list(self.group_keys),
            "params": [{"id": p.id, "fqn": p.fqn, "group": p.group, "state_keys": list(p.state_keys)}
                       for p in self.params],
        }

    @classmethod
    def from_json(cls, document: dict) -> OptimizerTable:
        """The table ``to_json`` wrote; anything else (a hand-edited or hostile manifest) is refused by name."""
        try:
            if document["key_form"] not in KEY_FORMS:
                raise ValueError(f"unknown key_form {document['key_form']!r}")
            sizes = document["group_sizes"]
            table = cls(
                path=tuple(document["path"]),
                key_form=document["key_form"],
                params=tuple(ParamEntry(p["id"], p["fqn"], p["group"], tuple(p["state_keys"]))
                             for p in document["params"]),
                group_sizes=tuple(sizes) if sizes is not None else None,
                group_keys=tuple(document.get("group_keys", ())),
            )
            _check_types(table)
            return table
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedMetadataError(f"malformed optimizer table in the manifest: {exc!r}") from exc


def _check_types(table: OptimizerTable) -> None:
    def of(value, *types) -> bool:
        return type(value) in types

    if not all(of(part, str, int) for part in table.path):
        raise ValueError(f"path {list(table.path)!r}")
    if table.group_sizes is not None and not all(of(n, int) for n in table.group_sizes):
        raise ValueError(f"group_sizes {list(table.group_sizes)!r}")
    if not all(of(k, str) for k in table.group_keys):
        raise ValueError(f"group_keys {list(table.group_keys)!r}")
    for p in table.params:
        if not (of(p.id, int, type(None)) and of(p.fqn, str, type(None)) and of(p.group, int, type(None))
                and all(of(k, str) for k in p.state_keys)):
            raise ValueError(f"param {p!r}")


# -- discovery ------------------------------------------------------------------------------------------------------


def find_optimizers(paths: Mapping[str, Sequence], value_of: Callable[[str], object],
                    ordered: bool = True) -> list[OptimizerTable]:
    """Every optimizer state dict in a flattened state dict.

    ``paths`` maps each DCP flat key to its path (dict keys as str, list indices as int), in state-dict order;
    ``value_of(key)`` gives a non-tensor value (the ``params`` lists). A nested optimizer is recognised by its
    ``param_groups[g]["params"]`` lists, a flattened one by its ``param_groups.{fqn}.{k}`` keys; the flattened
    form's ids are the order of those keys, which is trusted only when ``ordered`` (state-dict order).
    """
    tuple_paths = {key: tuple(path) for key, path in paths.items()}
    nested = _nested_optimizers(tuple_paths, value_of)
    taken = {table.path for table in nested}
    return nested + [t for t in _flattened_optimizers(tuple_paths, ordered) if t.path not in taken]


def _nested_optimizers(paths: dict[str, tuple], value_of: Callable[[str], object]) -> list[OptimizerTable]:
    params_lists: dict[tuple, dict[int, list]] = {}
    for key, path in paths.items():
        if len(path) >= 3 and path[-1] == PARAMS and path[-3] == PARAM_GROUPS and isinstance(path[-2], int):
            value = value_of(key)
            if isinstance(value, (list, tuple)):
                params_lists.setdefault(path[:-3], {})[path[-2]] = list(value)
    tables = []
    for prefix, groups in params_lists.items():
        if sorted(groups) != list(range(len(groups))):
            continue  # not torch.optim's shape (a list of groups); leave it to literal key matching
        refs = [ref for g in range(len(groups)) for ref in groups[g]]
        if all(type(ref) is int for ref in refs):
            key_form = INT
        elif all(isinstance(ref, str) for ref in refs):
            key_form = FQN
        else:
            continue
        state_names, group_keys = _nested_names(paths, prefix)
        params, position = [], 0
        for g in range(len(groups)):
            for ref in groups[g]:
                params.append(ParamEntry(
                    id=position, fqn=ref if key_form == FQN else None, group=g,
                    state_keys=tuple(sorted(state_names.get(str(ref), ()))),
                ))
                position += 1
        tables.append(OptimizerTable(prefix, key_form, tuple(params), tuple(len(groups[g]) for g in range(len(groups))),
                                     tuple(sorted(group_keys))))
    return tables


def _nested_names(paths: dict[str, tuple], prefix: tuple) -> tuple[dict[str, set], set]:
    n = len(prefix)
    state_names: dict[str, set] = {}
    group_keys: set = set()
    for path in paths.values():
        if path[:n] != prefix or len(path) < n + 3:
            continue
        if path[n] == STATE:
            # Nested state (Shampoo-like) keeps its inner path, dotted, as DCP's flat key does.
            state_names.setdefault(str(path[n + 1]), set()).add(".".join(map(str, path[n + 2:])))
        elif path[n] == PARAM_GROUPS and len(path) == n + 3 and path[n + 2] != PARAMS:
            group_keys.add(str(path[n + 2]))
    return state_names, group_keys


def _flattened_optimizers(paths: dict[str, tuple], ordered: bool) -> list[OptimizerTable]:
    group_names: dict[tuple, dict[str, set]] = {}  # prefix -> fqn (first-seen order) -> hyperparameter names
    for path in paths.values():
        last = path[-1] if path else None
        if isinstance(last, str) and last.startswith(PARAM_GROUPS + "."):
            fqn, _, name = last[len(PARAM_GROUPS) + 1:].rpartition(".")  # hyperparameter names hold no dots
            if fqn:
                group_names.setdefault(path[:-1], {}).setdefault(fqn, set()).add(name)
    tables = []
    for prefix, fqns in group_names.items():
        state_names: dict[str, set] = {}
        for path in paths.values():
            if path[:-1] != prefix or not isinstance(path[-1], str) or not path[-1].startswith(STATE + "."):
                continue
            owner, name = _split_known_fqn(path[-1][len(STATE) + 1:], fqns)
            if owner is not None:
                state_names.setdefault(owner, set()).add(name)
        params = tuple(ParamEntry(id=i if ordered else None, fqn=fqn, group=None,
                                  state_keys=tuple(sorted(state_names.get(fqn, ()))))
                       for i, fqn in enumerate(fqns))
        keys = sorted(set().union(*fqns.values()))
        tables.append(OptimizerTable(prefix, FLATTENED, params, None, tuple(keys)))
    return tables


def _split_known_fqn(rest: str, fqns: Mapping[str, object]) -> tuple[str | None, str]:
    """``"{fqn}.{name}"`` -> (fqn, name) for the longest known FQN; a state name may itself hold dots."""
    cut = rest.rfind(".")
    while cut > 0:
        if rest[:cut] in fqns:
            return rest[:cut], rest[cut + 1:]
        cut = rest.rfind(".", 0, cut)
    return None, rest


def tables_from_entries(entries: Mapping, key_order: Iterable[str] = ()) -> list[OptimizerTable]:
    """The optimizer tables of a manifest's entries (``manifest.Entry`` objects, keyed by fqn); ``key_order`` is
    the saved state dict's key order."""
    order = [key for key in key_order if key in entries]
    ordered = len(order) == len(entries)
    keys = order if ordered else list(entries)
    paths = {key: list(entries[key].path) for key in keys}

    def value_of(key: str):
        entry = entries[key]
        return decode_value(entry.value) if entry.kind == "value" else None

    return find_optimizers(paths, value_of, ordered=ordered)


def tables_of_manifest(manifest) -> list[OptimizerTable]:
    """The manifest's recorded tables; stores written before they were recorded get them rebuilt (no flat ids)."""
    if manifest.optimizers is None:
        return tables_from_entries(manifest.entries)
    return list(manifest.optimizers)
