"""The Zarr v3 data types core zarr-python lacks: bfloat16, float8_e4m3fn and float8_e5m2, backed by `ml_dtypes`.

Named as TensorStore names them, which TensorStore reads and writes. zarr-python finds them through the
``zarr.data_type`` entry points this package declares, so any program that has dcp-zarr installed opens these
arrays without importing dcp_zarr. That is why this module imports neither torch nor the rest of dcp_zarr: zarr
loads it while it resolves an array's data type. (The one exception, ``dtype_table``, imports only numpy. It holds
the table of stored dtypes, re-exported here, apart from zarr: importing zarr is a noticeable part of a command's
start-up, and the readers behind ``inspect``, ``verify`` and ``diff`` never need it.) Neither imports ml_dtypes
until one of its types is used.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import ClassVar, SupportsFloat, SupportsIndex, TypeGuard

import numpy as np
from zarr.dtype import ZDType, data_type_registry

from dcp_zarr.format.dtype_table import STORED_DTYPES  # noqa: F401 (re-exported: torch_arrays.py imports it from here)

# mypy checks both branches of these imports against the one zarr installed, where one of them is missing; the
# unused-ignore code keeps the ignore valid on a zarr where that import exists.
try:  # its home from zarr 3.4 on (importing it from zarr.dtype is deprecated there)
    from zarr.errors import DataTypeValidationError  # type: ignore[attr-defined,unused-ignore]
except ImportError:
    from zarr.dtype import DataTypeValidationError

try:  # no public home in zarr 3.1-3.4; the bytes codec asks for it to decide whether "endian" applies
    from zarr.core.dtype.common import HasEndianness, HasItemSize
except ImportError:  # pragma: no cover - a zarr that moved them
    from zarr.core.dtype import HasEndianness, HasItemSize  # type: ignore[no-redef,attr-defined,unused-ignore]


def _is_float_text(data: str) -> bool:
    """A float spelled as a JSON string: "NaN", "Infinity", "-Infinity" (how zarr v3 writes them) or "2.5"."""
    try:
        float(data)
    except ValueError:
        return False
    return True


def _float_to_json(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


class _FromMlDtypes:
    """A class attribute that is an ml_dtypes type (or its numpy dtype class), imported on first use: zarr loads this
    module whenever it resolves a data type, and importing ml_dtypes 0.7.0 takes 0.47 s on these machines
    (dtype_table.py)."""

    def __init__(self, name: str, dtype_class: bool = False) -> None:
        self.name, self.dtype_class = name, dtype_class

    def __get__(self, instance, owner) -> type:
        import ml_dtypes

        numpy_type = getattr(ml_dtypes, self.name)
        return type(np.dtype(numpy_type)) if self.dtype_class else numpy_type


@dataclass(frozen=True, kw_only=True)
class _MlDtypesFloat(ZDType, HasItemSize):
    """A float format that numpy only knows through `ml_dtypes`. Zarr v3 only: v2 has no name for these."""

    numpy_type: ClassVar[type]
    _zarr_v3_name: ClassVar[str]

    @classmethod
    def _check_native_dtype(cls, dtype) -> TypeGuard[np.dtype]:
        # zarr asks every registered type about every native dtype it meets: float32 must not import ml_dtypes, and
        # while ml_dtypes is not imported, no dtype can be one of its types
        return "ml_dtypes" in sys.modules and type(dtype) is cls.dtype_cls

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
            return data.startswith("0x") or _is_float_text(data)
        return isinstance(data, (SupportsFloat, SupportsIndex)) and not isinstance(data, (bool, np.bool_))

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
        return _float_to_json(float(value))


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MlDtypesFloat, HasEndianness):
    numpy_type = _FromMlDtypes("bfloat16")
    dtype_cls = _FromMlDtypes("bfloat16", dtype_class=True)
    _zarr_v3_name = "bfloat16"

    def to_native_dtype(self):
        # ml_dtypes has no byte-swapped bfloat16: numpy would silently turn it into raw bytes ('>V2').
        if self.endianness != "little":
            raise ValueError(f"bfloat16 is supported little-endian only, got endianness {self.endianness!r}")
        return np.dtype(self.numpy_type)


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MlDtypesFloat):
    numpy_type = _FromMlDtypes("float8_e4m3fn")
    dtype_cls = _FromMlDtypes("float8_e4m3fn", dtype_class=True)
    _zarr_v3_name = "float8_e4m3fn"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MlDtypesFloat):
    numpy_type = _FromMlDtypes("float8_e5m2")
    dtype_cls = _FromMlDtypes("float8_e5m2", dtype_class=True)
    _zarr_v3_name = "float8_e5m2"


ML_DTYPES_FLOATS = (BFloat16, Float8E4M3FN, Float8E5M2)


def register() -> None:
    """Make the types known to zarr. Registering replaces, never duplicates, so doing it again is harmless."""
    for zdtype in ML_DTYPES_FLOATS:
        data_type_registry.register(zdtype._zarr_v3_name, zdtype)


register()  # on import: how zarr < 3.4 gets them (see pyproject.toml), and a source tree that was never installed

