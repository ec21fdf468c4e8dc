"""Every dtype dcp_zarr stores, by torch's name for it: the numpy dtype its chunks hold and its Zarr v3 data type.

Needs neither torch nor zarr (only numpy, and ml_dtypes for the types it adds), so the readers behind ``dcp-zarr
inspect``, ``verify`` and ``diff`` size and read any array without importing either. ``zarr_dtypes.py`` defines the
zarr types for bfloat16 and float8 named here; ``torch_arrays.py`` maps torch.dtype objects onto this table.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

# Every dtype dcp_zarr stores, by the name torch gives it (as the manifest records it): (numpy dtype, or the name of
# an ml_dtypes type, zarr v3 data_type). Little-endian: that is what every writer here produces.
_ROWS: dict[str, tuple[np.dtype | str, str]] = {
    "torch.float64": (np.dtype("<f8"), "float64"),
    "torch.float32": (np.dtype("<f4"), "float32"),
    "torch.float16": (np.dtype("<f2"), "float16"),
    "torch.bfloat16": ("bfloat16", "bfloat16"),
    "torch.float8_e4m3fn": ("float8_e4m3fn", "float8_e4m3fn"),
    "torch.float8_e5m2": ("float8_e5m2", "float8_e5m2"),
    "torch.int8": (np.dtype("i1"), "int8"),
    "torch.int16": (np.dtype("<i2"), "int16"),
    "torch.int32": (np.dtype("<i4"), "int32"),
    "torch.int64": (np.dtype("<i8"), "int64"),
    "torch.uint8": (np.dtype("u1"), "uint8"),
    "torch.uint16": (np.dtype("<u2"), "uint16"),
    "torch.uint32": (np.dtype("<u4"), "uint32"),
    "torch.uint64": (np.dtype("<u8"), "uint64"),
    "torch.bool": (np.dtype("?"), "bool"),
    "torch.complex64": (np.dtype("<c8"), "complex64"),
    "torch.complex128": (np.dtype("<c16"), "complex128"),
}


class _StoredDtypes(Mapping[str, tuple[np.dtype, str]]):
    """``_ROWS`` with ml_dtypes imported on the first look-up of one of its types, not before: importing ml_dtypes
    0.7.0 takes 0.47 s on these machines (0.6.0: 4 ms), which a fresh process paid on its first save of a state
    without bfloat16 or float8 (benchmarks/reports/object-stores.md)."""

    def __getitem__(self, name: str) -> tuple[np.dtype, str]:
        numpy_type, zarr_name = _ROWS[name]
        if isinstance(numpy_type, str):
            import ml_dtypes

            numpy_type = np.dtype(getattr(ml_dtypes, numpy_type))
        return numpy_type, zarr_name

    def __iter__(self) -> Iterator[str]:
        return iter(_ROWS)

    def __len__(self) -> int:
        return len(_ROWS)


# Plain strings as keys, so tools that never import torch (inspect, verify, diff) can size and read any array;
# torch_arrays.py maps torch.dtype objects onto this table.
STORED_DTYPES: Mapping[str, tuple[np.dtype, str]] = _StoredDtypes()
# Each torch dtype name's zarr v3 data_type, without looking up its numpy dtype.
ZARR_DATA_TYPES: dict[str, str] = {name: zarr_name for name, (_, zarr_name) in _ROWS.items()}
