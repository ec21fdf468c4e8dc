"""Non-tensor state-dict values (hyperparameters, scheduler and dataloader state) as exact, tagged JSON.

Plain JSON loses types a resumed run can notice: tuples come back as lists, ``nan`` is not JSON, dicts with int keys
get string keys, and bytes and sets are not JSON at all. The tags below keep the round trip exact while the stored document stays ordinary JSON that any
zarr tool can show. Values that are not built from these types are not JSON: the writer stores them as
``torch.save`` bytes instead, which are only ever read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import base64
import json
import math

TUPLE_TAG = "__tuple__"
FLOAT_TAG = "__float__"
DICT_TAG = "__dict__"
BYTES_TAG = "__bytes__"  # base64
SET_TAG = "__set__"
FROZENSET_TAG = "__frozenset__"


class NotJSONError(TypeError):
    """The value holds something other than None, bool, int, float, str, bytes, list, tuple, set and dict."""


def encode_value(value):
    """Tagged JSON for ``value``; ``NotJSONError`` if it holds anything else."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {FLOAT_TAG: repr(value)}
    if kind is list:
        return [encode_value(v) for v in value]
    if kind is tuple:
        return {TUPLE_TAG: [encode_value(v) for v in value]}
    if kind is bytes:
        return {BYTES_TAG: base64.b64encode(value).decode("ascii")}
    if kind in (set, frozenset):
        # sorted by their JSON, so one set always gives one document
        items = sorted((encode_value(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
        return {SET_TAG if kind is set else FROZENSET_TAG: items}
    if kind is dict:
        if all(type(k) is str and not k.startswith("__") for k in value):
            return {k: encode_value(v) for k, v in value.items()}
        return {DICT_TAG: [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    raise NotJSONError(f"{kind.__name__} is not stored as JSON")


def decode_value(document):
    """The Python value that ``encode_value`` turned into ``document``."""
    if isinstance(document, list):
        return [decode_value(v) for v in document]
    if not isinstance(document, dict):
        return document
    if len(document) == 1:
        (tag, body), = document.items()
        if tag == TUPLE_TAG:
            return tuple(decode_value(v) for v in body)
        if tag == FLOAT_TAG:
            return float(body)
        if tag == DICT_TAG:
            return {_hashable(decode_value(k)): decode_value(v) for k, v in body}
        if tag == BYTES_TAG:
            return base64.b64decode(body.encode("ascii"), validate=True)
        if tag in (SET_TAG, FROZENSET_TAG):
            items = (_hashable(decode_value(v)) for v in body)
            return set(items) if tag == SET_TAG else frozenset(items)
    return {k: decode_value(v) for k, v in document.items()}


def _hashable(key):
    if isinstance(key, list):
        raise ValueError(f"a dict key decoded to a list ({key!r}); the stored value is malformed")
    return key
