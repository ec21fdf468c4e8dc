"""One-element tensors kept in their array's ``fill_value``, with no chunk stored (format 7).

An optimizer's ``step`` is one number per parameter: a 4- or 8-byte chunk each, which on an object store is a PUT to
save and a GET to load, a quarter of the requests of a small model's AdamW state (benchmarks/reports/object-stores.md,
"Where the time goes"). A Zarr array reads as its ``fill_value`` wherever a chunk is absent (zarr-python itself skips
writing a chunk equal to its fill value), so an array of one element whose ``fill_value`` is that element needs no
chunk: zarr-python, TensorStore and xarray read it as they read any array. The manifest's entry says so (``fill``),
which is how this library's readers know that the chunk is absent on purpose, not lost.

Only values of the plain numeric dtypes that every JSON reader parses exactly as the Zarr v3 spec writes them (a
number, or true/false): a non-finite float, an integer beyond +-2**53 or any other dtype is stored as a chunk, as
before.
"""

from __future__ import annotations

import math

import numpy as np

_INTEGER_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_FLOAT_TYPES = ("float16", "float32", "float64")
FILL_DATA_TYPES = frozenset(("bool", *_INTEGER_TYPES, *_FLOAT_TYPES))  # zarr v3 data types


def may_hold_in_fill(shape: tuple[int, ...], data_type: str) -> bool:
    """Whether an array of this shape and zarr ``data_type`` is one element that its fill_value can hold."""
    return math.prod(shape) == 1 and data_type in FILL_DATA_TYPES


# The largest integer every JSON reader parses exactly: JavaScript's JSON.parse (zarrita.js) reads numbers as
# doubles, so an int64 fill_value beyond 2**53 would read as another integer there (zarr-python and TensorStore
# read it exactly).
MAX_EXACT_INTEGER = 1 << 53


def fill_of(value) -> bool | int | float | None:
    """The JSON fill_value holding ``value`` (a one-element tensor's ``item()``), or None where JSON readers could
    misread it: a float that is not finite, an integer beyond +-2**53."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if type(value) is int and abs(value) > MAX_EXACT_INTEGER:
        return None
    return value


def checked_fill(fill, data_type: str, shape: tuple[int, ...]) -> bool | int | float:
    """``fill``, as a manifest entry of zarr ``data_type`` and ``shape`` may hold it; ValueError saying why not
    (the manifest names the entry)."""
    if not may_hold_in_fill(shape, data_type):
        raise ValueError(f"fill {fill!r}: a fill is stored only for one-element arrays of "
                         f"{', '.join(sorted(FILL_DATA_TYPES))}, not shape {list(shape)} {data_type}")
    if data_type == "bool":
        fits = type(fill) is bool
    elif data_type in _INTEGER_TYPES:
        info = np.iinfo(data_type)
        fits = type(fill) is int and info.min <= fill <= info.max
    else:
        fits = type(fill) in (int, float) and math.isfinite(fill)
    if not fits:
        raise ValueError(f"fill {fill!r} is not a {'finite ' if data_type in _FLOAT_TYPES else ''}{data_type} value")
    return fill


def filled(fill, dtype: np.dtype) -> np.ndarray:
    """A 0-d array of ``dtype`` holding ``fill``."""
    return np.asarray(fill, dtype=dtype)
