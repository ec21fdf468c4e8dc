"""What ``dcp-zarr inspect`` shows by default: a screenful, however many entries the checkpoint holds.

* Groups: names grouped by their leading dot-separated components, at most ``MAX_GROUP_ROWS`` rows, each with its
  entry and tensor counts, bytes and tensor dtypes. It starts from the first component (``model``, ``optim``,
  torchtitan's ``layers``) and splits the group with the most tensors into the groups one component deeper while the
  rows still fit, so small groups stay one row and large ones show their parts (``optim.state``,
  ``optim.param_groups``). Groups of values alone are not split: the values are listed below.
* Values: the non-tensor entries with their values, at most ``MAX_VALUE_LINES`` lines. Entries of one name and one
  value are one line under a glob that ``--filter`` takes (``optim.param_groups.*.lr = 0.0003  (x108)``: a flattened
  optimizer's hyperparameters, one per parameter). When there are more, those nearest the root are shown (a
  trainer's ``train_state.step`` before a param group's ``optim.param_groups.0.foreach``).

The tree of every entry is ``--tree``; groups at a fixed depth ``--depth N`` (listing.py).
"""

from __future__ import annotations

import io
from collections.abc import Iterable

from dcp_zarr.format.manifest import TENSOR
from dcp_zarr.format.values import decode_value
from dcp_zarr.tools.listing import natural_key

MAX_GROUP_ROWS = 20
MAX_VALUE_LINES = 24
_LONGEST_VALUE = 60


def summary_groups(rows: Iterable[dict], limit: int = MAX_GROUP_ROWS) -> list[dict]:
    """``[{"name", "entries", "tensors", "nbytes", "stored_bytes", "dtypes"}]`` for ``rows`` (``inspect``'s entry
    rows; ``stored_bytes`` None where a row's is unknown or absent), at most
    ``limit`` of them, in natural order: the module docstring's grouping. When the first components alone give more
    groups than that, the largest by bytes are kept and the rest summed in one last row named ``(N others)``."""
    rows = list(rows)
    names = {row["fqn"]: row["fqn"].split(".") for row in rows}
    groups: dict[tuple[str, ...], list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(names[row["fqn"]][:1]), []).append(row)
    tried: set[tuple[str, ...]] = set()
    while True:
        # values are listed below the groups, so only groups holding tensors are split
        splittable = {key: tensors for key, members in groups.items() if key not in tried
                      and (tensors := sum(r["kind"] == TENSOR for r in members))
                      and any(len(names[r["fqn"]]) > len(key) for r in members)}
        if not splittable:
            break
        key = max(splittable, key=lambda k: (splittable[k], len(groups[k])))
        tried.add(key)
        parts: dict[tuple[str, ...], list[dict]] = {}
        for row in groups[key]:
            parts.setdefault(tuple(names[row["fqn"]][:len(key) + 1]), []).append(row)
        if len(groups) - 1 + len(parts) <= limit:
            del groups[key]
            groups.update(parts)
    described = [_group(".".join(key), members) for key, members in groups.items()]
    described.sort(key=lambda g: natural_key(g["name"]))
    if len(described) <= limit:
        return described
    kept = sorted(described, key=lambda g: -g["nbytes"])[:limit - 1]
    others = [g for g in described if g not in kept]
    kept.sort(key=lambda g: natural_key(g["name"]))
    rest = _group(f"({len(others)} others)", [])
    for g in others:
        rest["entries"] += g["entries"]
        rest["tensors"] += g["tensors"]
        rest["nbytes"] += g["nbytes"]
        rest["stored_bytes"] = _add(rest["stored_bytes"], g["stored_bytes"])
        rest["dtypes"] = sorted(set(rest["dtypes"]) | set(g["dtypes"]))
    return [*kept, rest]


def _group(name: str, members: list[dict]) -> dict:
    tensors = [r for r in members if r["kind"] == TENSOR]
    stored: int | None = 0
    for r in members:
        stored = _add(stored, r.get("stored_bytes"))
    return {"name": name, "entries": len(members), "tensors": len(tensors),
            "nbytes": sum(r["nbytes"] for r in members), "stored_bytes": stored,
            "dtypes": sorted({r["dtype"] for r in tensors})}


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def summary_values(rows: Iterable[dict]) -> list[dict]:
    """``[{"name", "value", "count"}]``: every non-tensor entry of ``rows`` with its value as text (``value_text``),
    entries of one last name component and one value text merged under a glob of their names, in natural order."""
    merged: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if row["kind"] != TENSOR:
            merged.setdefault((row["fqn"].rsplit(".", 1)[-1], value_text(row)), []).append(row["fqn"])
    ordered = sorted(merged.items(), key=lambda item: natural_key(min(item[1], key=natural_key)))
    return [{"name": _glob_of(fqns), "value": text, "count": len(fqns)} for (_, text), fqns in ordered]


def shown_values(values: list[dict], limit: int = MAX_VALUE_LINES) -> tuple[list[dict], int]:
    """The lines of ``values`` (``summary_values``) to show, at most ``limit`` with the line saying how many more:
    fewest name components first, in their order; and how many are left out."""
    if len(values) <= limit:
        return values, 0
    by_depth = sorted(range(len(values)), key=lambda i: (values[i]["name"].count("."), i))
    kept = sorted(by_depth[:limit - 1])
    return [values[i] for i in kept], len(values) - len(kept)


def _glob_of(fqns: list[str]) -> str:
    """The name itself, or ``common.prefix.*.last`` for several names sharing their last component."""
    if len(fqns) == 1:
        return fqns[0]
    split = [fqn.split(".") for fqn in fqns]
    common: list[str] = []
    for parts in zip(*(s[:-1] for s in split)):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join([*common, "*", split[0][-1]])


def value_text(row: dict) -> str:
    """A non-tensor entry's value in one short line: its repr (cut at 60 characters), bytes by their size, objects
    (``torch.save`` bytes, decoded only where torch is) by their size."""
    if row["kind"] != "value":
        return f"torch.save bytes, {row['nbytes']} B"
    value = decode_value(row["value"])
    if isinstance(value, io.BytesIO):
        return f"BytesIO of {value.getbuffer().nbytes} bytes"
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    text = repr(value)
    return text if len(text) <= _LONGEST_VALUE else text[:_LONGEST_VALUE - 3] + "..."
