"""Whether an array's ``zarr.json`` is the one this version writes for a manifest entry: the layout it describes
agrees with the entry's grid, and its data type, codecs and chunk key encoding with the entry's dtype. An array whose
``zarr.json`` says otherwise (another data type, compression, no checksums) would be misread, so it is refused by
name instead. Torch-free: the CLI's ``verify`` and a load make the same checks."""

from __future__ import annotations

import functools

from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.codecs import Codec
from dcp_zarr.format.dtype_table import STORED_DTYPES
from dcp_zarr.format.encoding import array_metadata, layout_from_array_metadata


def checked_layout(doc: dict, where: str, fqn: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...] | None,
                   inner_rows: int, dtype: str, codec: Codec | None = None, fill=None) -> ChunkLayout:
    """The layout of the array whose ``zarr.json`` is ``doc``, for the manifest entry ``fqn`` of global ``shape``,
    grid ``chunk_shape`` (None: early format-1 entries, which leave it to the zarr.json), torch ``dtype`` name,
    ``codec`` and ``fill`` (the entry's value, kept in the fill_value: fill_values.py); MalformedMetadataError naming
    ``where`` (the store and node) when they disagree."""
    layout = layout_from_array_metadata(doc, where)
    if layout.shape != shape:
        raise MalformedMetadataError(f"{where} has shape {list(layout.shape)} but the manifest says {list(shape)}")
    if chunk_shape is not None and (layout.chunk_shape, layout.inner_rows) != (chunk_shape, inner_rows):
        raise MalformedMetadataError(
            f"{where} has chunks {list(layout.chunk_shape)} with inner chunks of {layout.inner_rows} rows, but the "
            f"manifest says {list(chunk_shape)} and {inner_rows}")
    np_dtype, zarr_name = STORED_DTYPES[dtype]  # a name the manifest checked (manifest.stored_numpy_dtype)
    expected = _encoded_as(layout, zarr_name, np_dtype.itemsize)
    for field in ("data_type", "codecs", "chunk_key_encoding"):
        if doc.get(field) != expected[field]:
            raise MalformedMetadataError(f"{where} of entry {fqn!r}: zarr.json has {field} {doc.get(field)!r}, but a "
                                         f"{dtype} entry is stored with {expected[field]!r}")
    if layout.codec != codec:
        said = "no compression" if codec is None else codec.description
        found = "no compression" if layout.codec is None else layout.codec.label
        raise MalformedMetadataError(f"{where} of entry {fqn!r}: zarr.json has {found}, but the manifest says {said}")
    stored_fill = doc.get("fill_value")
    if fill is not None and (stored_fill != fill or isinstance(stored_fill, bool) != isinstance(fill, bool)):
        # zarr tools read the fill_value, this library the manifest: they must agree
        raise MalformedMetadataError(f"{where} of entry {fqn!r}: zarr.json has fill_value {stored_fill!r}, "
                                     f"but the manifest says the array holds {fill!r}")
    return layout


@functools.lru_cache(maxsize=1024)
def _encoded_as(layout: ChunkLayout, zarr_name: str, itemsize: int) -> dict:
    """What the checked fields of an array's zarr.json must say (read only: shared by every array of the layout, as
    a model's arrays have few)."""
    return array_metadata(layout, zarr_name, itemsize)
