"""A save's non-tensor values as attributes of the groups that hold them, so that zarr tools show them:
``zarr.open_group(p, mode="r")["optim/param_groups/0"].attrs`` is the param group's hyperparameters (``lr``,
``betas``, ``params``, ...), ``["meta"].attrs`` a ``{"meta": {"epoch": 3}}``'s epoch.

The manifest's value entries stay what dcp_zarr loads from: these attributes are a copy, written once per save with
the group's ``zarr.json`` (and its copy in the root's consolidated metadata), never read back. A value is copied when
plain JSON holds it exactly but for the kind of sequence (a tuple, ``betas``, becomes a list); anything else is left
out of the attributes, not approximated: non-finite floats (JSON has none: zarr's own encoding of fill values, the
strings ``"NaN"`` and ``"Infinity"``, would read as strings), bytes, sets, ``io.BytesIO``, numpy values and dicts
with keys other than strings. Tensors, and values stored as ``torch.save`` bytes, are arrays of the group already.
At the root, the manifest's own attribute (``dcp_zarr``) wins over a value of that name. docs/format.md specifies it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dcp_zarr.format.manifest import MANIFEST_ATTRIBUTE, Entry, ValueEntry
from dcp_zarr.format.values import DICT_TAG, TAGS, TUPLE_TAG

# Names a group's values cannot take: the root's is the manifest.
_RESERVED = {"": frozenset((MANIFEST_ATTRIBUTE,))}
_SCALARS = frozenset((type(None), bool, int, float, str))


class NotPlainJSONError(ValueError):
    """A value that plain JSON cannot hold exactly; it is left out of its group's attributes."""


def group_attributes(entries: Mapping[str, Entry], key_order: Sequence[str] = ()) -> dict[str, dict]:
    """Group node (``""``: the root) -> the attributes its values give it: each value entry under its own name (the
    last component of its node), as plain JSON, in the saved state dict's order (``key_order``, fqns; entries it
    does not name follow in their own order). Groups without such values are not named."""
    values = {fqn: entry for fqn, entry in entries.items() if type(entry) is ValueEntry}
    if not values:
        return {}
    ordered = {fqn: values[fqn] for fqn in key_order if fqn in values}
    ordered.update(values)  # those key_order does not name, after the others
    attributes: dict[str, dict] = {}
    for entry in ordered.values():
        group, _, name = entry.node.rpartition("/")
        if name in _RESERVED.get(group, ()):
            continue
        try:
            attributes.setdefault(group, {})[name] = plain_json(entry.value)
        except (NotPlainJSONError, RecursionError):  # RecursionError: nested deeper than this stack allows
            pass
    return {group: names for group, names in attributes.items() if names}


def plain_json(document):
    """The plain JSON of a tagged value ``document`` (values.py), tuples as lists; ``NotPlainJSONError`` when plain
    JSON cannot hold the value exactly."""
    kind = type(document)
    if kind in _SCALARS:  # values.py tags non-finite floats
        return document
    if kind is list:
        if _SCALARS.issuperset(map(type, document)):  # params: hundreds of names, looked at in C
            return document
        return [plain_json(v) for v in document]
    if kind is not dict:
        raise NotPlainJSONError(f"{kind.__name__} is no tagged JSON")
    if len(document) == 1:
        (tag, body), = document.items()
        if tag == TUPLE_TAG and type(body) is list:
            return plain_json(body)
        if tag == DICT_TAG:  # a dict with a key values.py does not write as itself: plain when every key is a str
            if not all(type(key) is str for key, _ in body):
                raise NotPlainJSONError("a dict with keys other than strings")
            return {key: plain_json(value) for key, value in body}
        if tag in TAGS:
            raise NotPlainJSONError(f"a {tag} value")
    return {key: plain_json(value) for key, value in document.items()}
