"""Torch dtypes <-> Zarr v3 data types, bit-exact.

Core zarr-python has no bfloat16 or float8 data types, so this module defines them as `ZDType`s backed by
`ml_dtypes` and registers them (on import) under TensorStore's names, which TensorStore reads and writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np
import torch
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import DataTypeValidationError, HasEndianness, HasItemSize
from zarr.core.dtype.npy.common import FloatLike, check_json_floatish_str, float_to_json_v3
from zarr.core.dtype.wrapper import ZDType

from dcp_zarr.errors import ZarrCheckpointError


class UnsupportedDtypeError(ZarrCheckpointError, TypeError):
    """A torch dtype (or zarr data type name) that dcp_zarr cannot store bit-exactly."""


# ---- Zarr data types for the ml_dtypes floats -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _MlDtypesFloat(ZDType, HasItemSize):
    """A float format that numpy only knows through `ml_dtypes`. Zarr v3 only: v2 has no name for these."""

    numpy_type: ClassVar[type]
    _zarr_v3_name: ClassVar[str]

    @classmethod
    def from_native_dtype(cls, dtype):
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {cls._zarr_v3_name}")

    def to_native_dtype(self):
        return np.dtype(self.numpy_type)

    @classmethod
    def _check_json_v2(cls, data) -> bool:
        return False

    @classmethod
    def _from_json_v2(cls, data):
        raise DataTypeValidationError(f"{cls._zarr_v3_name} exists only in Zarr v3, got v2 JSON {data!r}")

    @classmethod
    def _check_json_v3(cls, data) -> bool:
        return data == cls._zarr_v3_name

    @classmethod
    def _from_json_v3(cls, data):
        if cls._check_json_v3(data):
            return cls()
        raise DataTypeValidationError(f"Expected {cls._zarr_v3_name!r}, got {data!r}")

    def to_json(self, zarr_format):
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"{self._zarr_v3_name} can only be stored in Zarr v3, not v{zarr_format}")

    @property
    def item_size(self) -> int:
        return self.to_native_dtype().itemsize

    def _bits_dtype(self) -> np.dtype:
        return np.dtype(f"<u{self.item_size}")

    def _check_scalar(self, data) -> bool:
        if isinstance(data, str):
            return data.startswith("0x") or data in ("NaN", "Infinity", "-Infinity") or check_json_floatish_str(data)
        return isinstance(data, FloatLike) and not isinstance(data, bool)

    def cast_scalar(self, data):
        if not self._check_scalar(data):
            raise TypeError(f"Cannot convert {data!r} ({type(data)}) to a scalar of data type {self._zarr_v3_name}")
        # zarr's shared float parser reads any 4-hex-digit "0x..." as float16 and 2 digits not at all; the v3 spec
        # means the big-endian bits of *this* type, which is also the only way to name one particular NaN.
        if isinstance(data, str) and data.startswith("0x"):
            if len(data) != 2 + 2 * self.item_size:
                raise ValueError(f"Fill value {data!r} is not {self.item_size} hex-encoded bytes")
            return np.array(int(data, 16), dtype=self._bits_dtype()).view(self.to_native_dtype())[()]
        return self.to_native_dtype().type(data)

    def default_scalar(self):
        return self.to_native_dtype().type(0)

    def from_json_scalar(self, data, *, zarr_format):
        return self.cast_scalar(data)

    def to_json_scalar(self, data, *, zarr_format):
        value = self.cast_scalar(data)
        bits = int(np.array(value).view(self._bits_dtype()))
        canonical_nan = int(np.array(np.nan, dtype=self.to_native_dtype()).view(self._bits_dtype()))
        if math.isnan(float(value)) and bits != canonical_nan:  # "NaN" would read back as the canonical NaN
            return f"0x{bits:0{2 * self.item_size}x}"
        return float_to_json_v3(float(value))


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MlDtypesFloat, HasEndianness):
    numpy_type = ml_dtypes.bfloat16
    dtype_cls = type(np.dtype(ml_dtypes.bfloat16))
    _zarr_v3_name = "bfloat16"

    def to_native_dtype(self):
        # ml_dtypes has no byte-swapped bfloat16: numpy would silently turn it into raw bytes ('>V2').
        if self.endianness != "little":
            raise ValueError(f"bfloat16 is supported little-endian only, got endianness {self.endianness!r}")
        return np.dtype(self.numpy_type)


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MlDtypesFloat):
    numpy_type = ml_dtypes.float8_e4m3fn
    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3fn))
    _zarr_v3_name = "float8_e4m3fn"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MlDtypesFloat):
    numpy_type = ml_dtypes.float8_e5m2
    dtype_cls = type(np.dtype(ml_dtypes.float8_e5m2))
    _zarr_v3_name = "float8_e5m2"


for _zdtype in (BFloat16, Float8E4M3FN, Float8E5M2):
    data_type_registry.register(_zdtype._zarr_v3_name, _zdtype)  # replaces, never duplicates: re-import is safe


# ---- torch <-> numpy <-> zarr ------------------------------------------------------------------------------------

# torch dtype -> (numpy dtype, zarr v3 data_type). Little-endian: that is what every writer here produces.
_SUPPORTED: dict[torch.dtype, tuple[np.dtype, str]] = {
    torch.float64: (np.dtype("<f8"), "float64"),
    torch.float32: (np.dtype("<f4"), "float32"),
    torch.float16: (np.dtype("<f2"), "float16"),
    torch.bfloat16: (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    torch.float8_e4m3fn: (np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
    torch.float8_e5m2: (np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2"),
    torch.int8: (np.dtype("i1"), "int8"),
    torch.int16: (np.dtype("<i2"), "int16"),
    torch.int32: (np.dtype("<i4"), "int32"),
    torch.int64: (np.dtype("<i8"), "int64"),
    torch.uint8: (np.dtype("u1"), "uint8"),
    torch.uint16: (np.dtype("<u2"), "uint16"),
    torch.uint32: (np.dtype("<u4"), "uint32"),
    torch.uint64: (np.dtype("<u8"), "uint64"),
    torch.bool: (np.dtype("?"), "bool"),
    torch.complex64: (np.dtype("<c8"), "complex64"),
    torch.complex128: (np.dtype("<c16"), "complex128"),
}
_BY_ZARR_NAME = {name: dtype for dtype, (_, name) in _SUPPORTED.items()}
_BY_TORCH_NAME = {str(dtype): dtype for dtype in _SUPPORTED}
# torch.Tensor.numpy() rejects these, so they cross as same-width integers and are reinterpreted on each side.
_BITS_AS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _lookup(torch_dtype: torch.dtype) -> tuple[np.dtype, str]:
    try:
        return _SUPPORTED[torch_dtype]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(f"dtype {torch_dtype} is not supported by dcp_zarr") from None


def zarr_dtype_name(torch_dtype: torch.dtype) -> str:
    return _lookup(torch_dtype)[1]


def torch_dtype_from_zarr_name(name: str) -> torch.dtype:
    try:
        return _BY_ZARR_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(f"zarr data type {name!r} is not supported by dcp_zarr") from None


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
    if any(stride < 0 for stride in a.strides):
        a = a.copy()  # torch.from_numpy refuses negative strides
    bits_dtype = _BITS_AS.get(torch_dtype)
    if bits_dtype is None:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(numpy_dtype(bits_dtype))).view(torch_dtype)
