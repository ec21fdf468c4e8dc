"""Non-tensor state-dict values (hyperparameters, scheduler and dataloader state) as exact, tagged JSON.

Plain JSON loses types a resumed run can notice: tuples come back as lists, ``nan`` is not JSON, dicts with int keys
get string keys, and bytes and sets are not JSON at all. The tags below keep the round trip exact while the stored
document stays ordinary JSON that any zarr tool can show. ``io.BytesIO`` (DCP's own way to save opaque state) and
numpy arrays and scalars of plain numeric dtypes (numpy RNG states, dataloader positions) are tagged too, so that
they load without unpickling anything. Values that are not built from these types are not JSON: the writer stores
them as ``torch.save`` bytes instead, which are only ever read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import base64
import io
import json
import math

import numpy as np

TUPLE_TAG = "__tuple__"
FLOAT_TAG = "__float__"
DICT_TAG = "__dict__"
BYTES_TAG = "__bytes__"  # base64
SET_TAG = "__set__"
FROZENSET_TAG = "__frozenset__"
BYTESIO_TAG = "__bytesio__"  # base64 of the buffer's whole contents; it loads positioned at 0
NDARRAY_TAG = "__ndarray__"  # {"dtype": "<f4", "shape": [...], "data": base64 of the C-order bytes}
NUMPY_SCALAR_TAG = "__numpy_scalar__"  # {"dtype": "<i8", "data": base64}
# (The last three since format 4: a format-3 reader would hand them back as dicts, so it refuses format 4.)
# A one-key dict whose key is one of these is a tagged value: every dict with a key starting with "__" is tagged.
TAGS = frozenset((TUPLE_TAG, FLOAT_TAG, DICT_TAG, BYTES_TAG, SET_TAG, FROZENSET_TAG, BYTESIO_TAG, NDARRAY_TAG,
                  NUMPY_SCALAR_TAG))
# Bytes, BytesIO and numpy arrays larger than this are not JSON: the root zarr.json, which every reader fetches
# and parses whole, stays small; they are stored as torch.save bytes instead, whose types load by default.
MAX_JSON_BLOB_BYTES = 64 << 10
# numpy dtypes stored by value: booleans, integers, floats and complex numbers of the sizes every platform has
# (x86's 16-byte long double is no dtype on ARM: one such value would make a manifest unreadable there).
_NUMPY_ITEMSIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16)}


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
    if kind is bytes and len(value) <= MAX_JSON_BLOB_BYTES:
        return {BYTES_TAG: _b64(value)}
    if kind is io.BytesIO and value.getbuffer().nbytes <= MAX_JSON_BLOB_BYTES:
        return {BYTESIO_TAG: _b64(value.getvalue())}
    if kind is np.ndarray and _plain_numpy(value.dtype) and value.nbytes <= MAX_JSON_BLOB_BYTES:
        return {NDARRAY_TAG: {"dtype": value.dtype.str, "shape": list(value.shape),
                              "data": _b64(np.ascontiguousarray(value).tobytes())}}
    if isinstance(value, np.generic) and _plain_numpy(value.dtype):
        return {NUMPY_SCALAR_TAG: {"dtype": value.dtype.str, "data": _b64(value.tobytes())}}
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
            return _unb64(body)
        if tag == BYTESIO_TAG:
            return io.BytesIO(_unb64(body))
        if tag == NDARRAY_TAG:
            return _numpy_value(body, tag).reshape(_shape(body)).copy()  # a writable array of its own
        if tag == NUMPY_SCALAR_TAG:
            values = _numpy_value(body, tag)
            if values.size != 1:
                raise ValueError(f"a {tag} holds {values.size} values, not 1")
            return values[0]
        if tag in (SET_TAG, FROZENSET_TAG):
            items = (_hashable(decode_value(v)) for v in body)
            return set(items) if tag == SET_TAG else frozenset(items)
    return {k: decode_value(v) for k, v in document.items()}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(body) -> bytes:
    if not isinstance(body, str):
        raise ValueError(f"base64 text expected, got {type(body).__name__}")
    return base64.b64decode(body.encode("ascii"), validate=True)


def _plain_numpy(dtype: np.dtype) -> bool:
    """A dtype whose ``.str`` names it exactly (not object, structured, datetime or ml_dtypes' bfloat16, '<V2')."""
    return dtype.itemsize in _NUMPY_ITEMSIZES.get(dtype.kind, ()) and np.dtype(dtype.str) == dtype


def _numpy_value(body, tag: str) -> np.ndarray:
    if not isinstance(body, dict) or not isinstance(body.get("dtype"), str):
        raise ValueError(f"a {tag} needs a dtype string, got {body!r:.80}")
    try:
        dtype = np.dtype(body["dtype"])
    except TypeError:
        raise ValueError(f"a {tag} has dtype {body['dtype']!r}, which numpy does not know here") from None
    if not _plain_numpy(dtype):
        raise ValueError(f"a {tag} has dtype {body['dtype']!r}, not a plain numeric one")
    return np.frombuffer(_unb64(body.get("data")), dtype=dtype)


def _shape(body) -> tuple[int, ...]:
    shape = body.get("shape")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"a {NDARRAY_TAG} has shape {shape!r}")
    return tuple(shape)


def _hashable(key):
    if isinstance(key, list):
        raise ValueError(f"a dict key decoded to a list ({key!r}); the stored value is malformed")
    return key
