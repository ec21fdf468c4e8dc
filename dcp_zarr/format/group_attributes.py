"""A save's non-tensor values as attributes of the groups that hold them, so that zarr tools show them:
``zarr.open_group(p, mode="r")["optim/param_groups/0"].attrs`` is the param group's hyperparameters (``lr``,
``betas``, ``params``, ...), ``["meta"].attrs`` a ``{"meta": {"epoch": 3}}``'s epoch.

The manifest's value entries stay what dcp_zarr loads from: these attributes are a copy, written once per save with
the group's ``zarr.json`` (and its copy in the root's, node_copies.py), never read back. A value is copied when
plain JSON holds it exactly but for the kind of sequence (a tuple, ``betas``, becomes a list). Any other value held in
the manifest (non-finite floats, bytes, sets, ``io.BytesIO``, numpy values, dicts with keys other than strings) is
described instead, under the group's own ``dcp_zarr`` attribute: its kind, its size and how to read it from the
manifest, never an approximation that would read as the value (zarr's encoding of NaN is the string ``"NaN"``).
Tensors, and values stored as ``torch.save`` bytes, are arrays of the group already, each describing itself. At the
root, ``dcp_zarr`` is the manifest, which holds every value: root values that are not plain JSON are described there
only. docs/format.md specifies it.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np

from dcp_zarr.format.manifest import MANIFEST_ATTRIBUTE, Entry, ValueEntry
from dcp_zarr.format.values import (
    BYTES_TAG,
    BYTESIO_TAG,
    DICT_TAG,
    FLOAT_TAG,
    NDARRAY_TAG,
    NUMPY_SCALAR_TAG,
    TAGS,
    TUPLE_TAG,
    decode_value,
)

_SCALARS = frozenset((type(None), bool, int, float, str))
# How to read each kind with the standard library and numpy, as a Python expression in which ``manifest`` is the
# root's dcp_zarr attribute and {value} the value's tagged JSON there; the rest needs values.py's decoder.
_READ = {
    BYTES_TAG: f"base64.b64decode({{value}}['{BYTES_TAG}'])",
    BYTESIO_TAG: f"io.BytesIO(base64.b64decode({{value}}['{BYTESIO_TAG}']))",
    NDARRAY_TAG: "(lambda v: numpy.frombuffer(base64.b64decode(v['data']), v['dtype']).reshape(v['shape']))"
                 f"({{value}}['{NDARRAY_TAG}'])",
    NUMPY_SCALAR_TAG: "(lambda v: numpy.frombuffer(base64.b64decode(v['data']), v['dtype'])[0])"
                      f"({{value}}['{NUMPY_SCALAR_TAG}'])",
    FLOAT_TAG: f"float({{value}}['{FLOAT_TAG}'])",
}
_DECODER = "dcp_zarr.format.values.decode_value({value})"
_LONGEST_REPR = 80
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6


class NotPlainJSONError(ValueError):
    """A value that plain JSON cannot hold exactly; its group describes it instead."""


def group_attributes(entries: Mapping[str, Entry], key_order: Sequence[str] = ()) -> dict[str, dict]:
    """Group node (``""``: the root) -> the attributes its values give it: each value entry under its own name (the
    last component of its node), as plain JSON, in the saved state dict's order (``key_order``, fqns; entries it
    does not name follow in their own order); the values plain JSON cannot hold, and a value named ``dcp_zarr``,
    described under ``dcp_zarr`` (``{"values": {name: description}}``), except at the root, whose ``dcp_zarr`` is
    the manifest. Groups without such values are not named."""
    values = {fqn: entry for fqn, entry in entries.items() if type(entry) is ValueEntry}
    if not values:
        return {}
    ordered = {fqn: values[fqn] for fqn in key_order if fqn in values}
    ordered.update(values)  # those key_order does not name, after the others
    attributes: dict[str, dict] = {}
    described: dict[str, dict] = {}
    for entry in ordered.values():
        group, _, name = entry.node.rpartition("/")
        try:
            if name == MANIFEST_ATTRIBUTE:
                raise NotPlainJSONError(f"{name} is the group's own attribute")
            attributes.setdefault(group, {})[name] = plain_json(entry.value)
        except (NotPlainJSONError, RecursionError):  # RecursionError: nested deeper than this stack allows
            if group:
                described.setdefault(group, {})[name] = describe(entry.fqn, entry.value)
    for group, names in described.items():
        attributes.setdefault(group, {})[MANIFEST_ATTRIBUTE] = {"values": names}
    return {group: names for group, names in attributes.items() if names}


def describe(fqn: str, document) -> dict:
    """What zarr tools are told of a value held in the manifest as tagged JSON ``document``: the manifest's entry
    that holds it, its Python type, its size, its ``repr`` when short, what opaque bytes hold when their first bytes
    say it, and a Python expression that reads it (``manifest``: the root's ``dcp_zarr`` attribute)."""
    value = decode_value(document)
    kind = type(value)
    description: dict = {"entry": fqn, "kind": "io.BytesIO" if kind is io.BytesIO else
                         f"numpy.{kind.__name__}" if isinstance(value, (np.ndarray, np.generic)) else kind.__name__}
    if kind in (bytes, io.BytesIO):
        data = value if kind is bytes else value.getvalue()
        description["nbytes"] = len(data)
        content = _content(data)
        if content:
            description["content"] = content
    elif isinstance(value, (np.ndarray, np.generic)):
        description.update(dtype=value.dtype.str, shape=list(value.shape), nbytes=value.nbytes)
    elif isinstance(value, (set, frozenset, dict, tuple, list)):
        description["len"] = len(value)
    if kind not in (bytes, io.BytesIO):
        text = repr(value)
        if len(text) <= _LONGEST_REPR:
            description["repr"] = text
    tag = next(iter(document)) if type(document) is dict and len(document) == 1 else ""
    where = f"manifest['entries'][{fqn!r}]['value']"
    description["read"] = _READ.get(tag, _DECODER).format(value=where)
    return description


def _content(data: bytes) -> str | None:
    """What opaque bytes hold, when their first bytes say it: a pickle (torchtitan's dataloader state), torch.save's
    zip (DCP's TrainState)."""
    if len(data) > 2 and data[0] == 0x80 and 2 <= data[1] <= 5 and data.endswith(b"."):
        return f"pickle protocol {data[1]}: pickle.loads reads it (unpickle only what you trust)"
    if data.startswith(_ZIP_MAGIC):
        return "a zip file, as torch.save writes: torch.load(..., weights_only=True) reads it"
    return None


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
