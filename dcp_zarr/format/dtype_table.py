"""Every dtype dcp_zarr stores, by torch's name for it: the numpy dtype its chunks hold and its Zarr v3 data type.

Needs neither torch nor zarr (only numpy and ml_dtypes), so the readers behind ``dcp-zarr inspect``, ``verify`` and
``diff`` size and read any array without importing either. ``zarr_dtypes.py`` defines the zarr types for bfloat16
and float8 named here; ``torch_arrays.py`` maps torch.dtype objects onto this table.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# Every dtype dcp_zarr stores, by the name torch gives it (as the manifest records it): (numpy dtype, zarr v3
# data_type). Little-endian: that is what every writer here produces. Plain strings, so tools that never import torch
# (inspect, verify, diff) can size and read any array; torch_arrays.py maps torch.dtype objects onto this table.
STORED_DTYPES: dict[str, tuple[np.dtype, str]] = {
    "torch.float64": (np.dtype("<f8"), "float64"),
    "torch.float32": (np.dtype("<f4"), "float32"),
    "torch.float16": (np.dtype("<f2"), "float16"),
    "torch.bfloat16": (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    "torch.float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
    "torch.float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2"),
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
