"""An array as a save writes it: its node, zarr data type and chunk layout, and the torch dtype it holds."""

from __future__ import annotations

from typing import NamedTuple

from dcp_zarr.format.chunk_layout import ChunkLayout


class ArraySpec(NamedTuple):
    """Everything a rank needs to write its part of one array.

    A NamedTuple, not a frozen dataclass: every rank unpickles thousands of these with its plan, and frozen
    dataclasses unpickle more than an order of magnitude slower (a one-off measurement, not kept).
    """

    fqn: str
    node: str
    data_type: str
    itemsize: int
    layout: ChunkLayout
    dtype_name: str  # the torch dtype's name, recorded in the array's attributes
