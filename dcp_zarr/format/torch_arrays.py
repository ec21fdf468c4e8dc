"""Torch dtypes <-> Zarr v3 data types, bit-exact (the table itself is in the torch-free dtype_table.py, the zarr
types for bfloat16 and float8 in zarr_dtypes.py)."""

from __future__ import annotations

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import numpy as np
import torch

from dcp_zarr.errors import UnsupportedDtypeError
from dcp_zarr.format.dtype_table import ZARR_DATA_TYPES
from dcp_zarr.format.zarr_dtypes import STORED_DTYPES  # importing it registers the zarr data types

# ---- torch <-> numpy <-> zarr ------------------------------------------------------------------------------------

# torch dtype -> its name in STORED_DTYPES (whose rows are looked up on use: some import ml_dtypes).
_SUPPORTED: dict[torch.dtype, str] = {getattr(torch, name.removeprefix("torch.")): name for name in STORED_DTYPES}
_BY_ZARR_NAME = {ZARR_DATA_TYPES[name]: dtype for dtype, name in _SUPPORTED.items()}
_BY_TORCH_NAME = {str(dtype): dtype for dtype in _SUPPORTED}
# torch.Tensor.numpy() rejects these, so they cross as same-width integers and are reinterpreted on each side.
_BITS_AS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _lookup(torch_dtype: torch.dtype) -> tuple[np.dtype, str]:
    try:
        return STORED_DTYPES[_SUPPORTED[torch_dtype]]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(f"dtype {torch_dtype} is not supported by dcp_zarr") from None


def zarr_dtype_name(torch_dtype: torch.dtype) -> str:
    return _lookup(torch_dtype)[1]


def torch_dtype_from_zarr_name(name: str) -> torch.dtype:
    try:
        return _BY_ZARR_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(f"zarr data type {name!r} is not supported by dcp_zarr; if a newer dcp-zarr "
                                    "saved it, upgrade this one (pip install -U dcp-zarr) to read it") from None


def numpy_dtype(torch_dtype: torch.dtype) -> np.dtype:
    return _lookup(torch_dtype)[0]


def torch_dtype_name(torch_dtype: torch.dtype) -> str:
    _lookup(torch_dtype)
    return str(torch_dtype)


def torch_dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_TORCH_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(f"torch dtype {name!r} is not supported by dcp_zarr") from None


def tensor_as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing `t`'s memory (strides kept). Copies only to resolve a lazy conj/neg bit."""
    np_dtype = numpy_dtype(t.dtype)
    if t.device.type != "cpu":
        raise ValueError(f"expected a CPU tensor, got one on {t.device}")
    t = t.detach().resolve_conj().resolve_neg()
    bits_dtype = _BITS_AS.get(t.dtype)
    if bits_dtype is None:
        return t.numpy()
    return t.view(bits_dtype).numpy().view(np_dtype)


def numpy_as_tensor(a: np.ndarray, torch_dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharing `a`'s memory; copies only when torch cannot view it (byte-swapped, negative strides)."""
    expected = numpy_dtype(torch_dtype)
    a = np.asarray(a)  # zarr returns a numpy scalar, not a 0-d array, for a 0-d read
    if a.dtype != expected:
        if a.dtype.newbyteorder("<") != expected:
            raise UnsupportedDtypeError(f"array of dtype {a.dtype} does not hold {torch_dtype} (needs {expected})")
        a = a.astype(expected)  # a byte swap, exact
    if a.size == 0:  # nothing to share, and numpy gives empty arrays 0 strides, which torch's .view() refuses
        return torch.empty(a.shape, dtype=torch_dtype)
    if any(stride < 0 for stride in a.strides):
        a = a.copy()  # torch.from_numpy refuses negative strides
    bits_dtype = _BITS_AS.get(torch_dtype)
    if bits_dtype is None:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(numpy_dtype(bits_dtype))).view(torch_dtype)
