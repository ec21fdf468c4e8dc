"""Which entries ``dcp-zarr inspect`` lists, and in what order: names sorted naturally, ``--filter`` globs, and
``--depth`` groups.

* Natural order: runs of digits compare as numbers, so ``layers.2`` comes before ``layers.10``.
* ``--filter PATTERN``: a shell-style glob (``fnmatch``, case-sensitive) matched against the whole flattened name
  (``optim.state.layers.0.w.exp_avg``); ``*`` matches any characters, dots included, so ``*.exp_avg`` is every
  Adam first moment. Repeated, an entry is kept if it matches any of them.
* ``--depth N``: names grouped by their first N dot-separated components (``model.layers`` at depth 2), like
  ``du --max-depth``: each group with its entry count and bytes; a name with fewer components is a group of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from dcp_zarr.format.manifest import TENSOR

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key: ``layers.2`` before ``layers.10``; the name itself breaks ties (``01`` vs ``1``)."""
    parts = _DIGITS.split(name)  # text, digits, text, ...: position decides the type, so keys always compare
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name


def node_key(node: str) -> tuple:
    """Sort key of a zarr node path (``model/layers.10.w``): component by component, each naturally."""
    return tuple(natural_key(part) for part in node.split("/"))


def check_glob(pattern: str) -> str:
    """``pattern`` if it is a usable glob; ValueError saying why not. fnmatch takes an unclosed ``[`` literally,
    which would silently match nothing, so it is refused here."""
    if not pattern:
        raise ValueError("the pattern is empty")
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] == "!":
                j += 1
            if j < len(pattern) and pattern[j] == "]":  # a "]" first in a set is a member, as in fnmatch
                j += 1
            close = pattern.find("]", j)
            if close < 0:
                raise ValueError(f"{pattern!r} has an unclosed '[' at position {i} (write '[[]' for a literal '[')")
            i = close
        i += 1
    return pattern


def matches(name: str, patterns: Sequence[str] | None) -> bool:
    """Whether ``name`` is listed under ``patterns`` (None or empty: everything is)."""
    return not patterns or any(fnmatchcase(name, p) for p in patterns)


def depth_groups(rows: Iterable[dict], depth: int) -> list[dict]:
    """``[{"name", "entries", "tensors", "nbytes"}]`` for ``rows`` (``inspect``'s entry rows) grouped by the first
    ``depth`` dot-separated components of their names, in natural order."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    groups: dict[str, dict] = {}
    for row in rows:
        name = ".".join(row["fqn"].split(".")[:depth])
        group = groups.setdefault(name, {"name": name, "entries": 0, "tensors": 0, "nbytes": 0})
        group["entries"] += 1
        group["tensors"] += row["kind"] == TENSOR
        group["nbytes"] += row["nbytes"]
    return [groups[name] for name in sorted(groups, key=natural_key)]
