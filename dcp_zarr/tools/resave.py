"""Conversions to a zarr store: a DCP directory or a dcp_zarr store read whole and saved again with ``ZarrWriter``
(compressed or not). Needs torch (``dcp.save``)."""

from __future__ import annotations

import os
import warnings

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch.distributed.checkpoint as dcp

from dcp_zarr.errors import CheckpointExistsError, ConversionError, IncompleteCheckpointError, NotACheckpointError
from dcp_zarr.format.compression import COMPRESSORS, Compression
from dcp_zarr.format.manifest import TensorEntry
from dcp_zarr.offline import Checkpoint, open_checkpoint
from dcp_zarr.storage import directory_of, storage_class
from dcp_zarr.store_io import commit
from dcp_zarr.tools.dcp_dir import DcpCheckpoint
from dcp_zarr.writer import ZarrWriter

# ``compression`` of a conversion to zarr: the source's (a zarr store's compressor and level; none for a DCP
# directory). "none" (or None, False) stores every array as it is; a compressor's name, True or a Compression
# compresses as ``ZarrWriter(compression=...)`` does.
KEEP = "keep"
COMPRESSION_CHOICES = (KEEP, "none", *COMPRESSORS)


def dcp_to_zarr(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False,
                storage_options: dict | None = None, thread_count: int = 4, compression=KEEP) -> None:
    """Re-save a DCP directory as a zarr store with ``ZarrWriter`` (unsharded: it is read whole into memory);
    ``compression`` as ``ZarrWriter``'s, or ``KEEP`` (the default): none."""
    chosen = writer_compression(compression, None)  # a bad value is refused before anything is read
    source = DcpCheckpoint(src)  # checks every .distcp file is there before anything is written
    _resave(source, dst, overwrite, storage_options, thread_count, chosen)


def zarr_to_zarr(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False,
                 storage_options: dict | None = None, thread_count: int = 4, compression=KEEP) -> None:
    """Re-save a dcp_zarr store as a new one, read whole into memory and saved unsharded as ``dcp_to_zarr`` does:
    to compress a store (``compression="zstd"``), store it as it is (``compression=None``) or rewrite it in the
    current format. ``KEEP`` (the default) compresses as the source is compressed: with its compressor and level
    where it holds compressed arrays, not at all where it holds none. ``src`` and ``dst`` may be one local store
    (with ``overwrite=True``): the new one is written beside it and swapped in once complete."""
    chosen = writer_compression(compression, None)
    try:
        source = open_checkpoint(src, storage_options)
    except IncompleteCheckpointError:
        raise
    except NotACheckpointError as exc:
        raise ConversionError(f"{os.fspath(src)} is neither a DCP checkpoint directory (.metadata + .distcp files) "
                              f"nor a dcp_zarr store, which --to zarr converts ({exc})") from None
    if compression == KEEP:
        chosen = source_compression(source)
    if _same_store(src, dst):
        if not storage_class(os.fspath(src)).commits_by_rename:
            raise ConversionError(f"{os.fspath(src)}: converting a store into itself needs a local path (an object "
                                  "store's overwrite deletes the old store before the new one is complete)")
        if not overwrite:
            raise CheckpointExistsError(f"{os.fspath(dst)} is the source itself; pass --overwrite (overwrite=True) "
                                        "to replace it with the converted store, or choose another output path")
    _resave(source, dst, overwrite, storage_options, thread_count, chosen)


def _resave(source: Checkpoint | DcpCheckpoint, dst: str | os.PathLike, overwrite: bool,
            storage_options: dict | None, thread_count: int, compression: Compression | None) -> None:
    # refuse now, not after a long read; --overwrite is explicit, so it replaces an interrupted save too
    commit.check_target(os.fspath(dst), storage_options, overwrite, replace_interrupted=overwrite)
    state = source.load_full_state_dict()
    writer = ZarrWriter(dst, storage_options=storage_options, overwrite=overwrite, thread_count=thread_count,
                        compression=compression)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        dcp.save(state, storage_writer=writer, no_dist=True)


def writer_compression(value, kept: Compression | None) -> Compression | None:
    """``compression`` of a conversion to zarr as ``ZarrWriter`` takes it: ``KEEP`` gives ``kept``, ``"none"``
    gives None; anything else is ``Compression.of``'s. ConversionError naming the option for a bad value."""
    if value == KEEP:
        return kept
    if value == "none":
        return None
    try:
        return Compression.of(value)
    except (TypeError, ValueError):
        raise ConversionError(f"compression={value!r}: expected one of {', '.join(COMPRESSION_CHOICES)}, True, "
                              "None or a dcp_zarr.Compression") from None


def source_compression(source: Checkpoint) -> Compression | None:
    """How ``source``'s arrays are compressed, as a Compression (its most common compressor and level), or None
    where none is. Its other options (the smallest array compressed, the ratio a sample must reach) are not
    recorded in a store: the defaults."""
    counts: dict[tuple[str, int], int] = {}
    for stored in source.manifest.entries.values():
        if isinstance(stored, TensorEntry) and stored.codec is not None:
            key = stored.codec.written_by()
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    compressor, level = max(counts, key=lambda k: counts[k])
    try:
        return Compression(compressor=compressor, level=level)
    except ValueError:  # a level the zarr codec takes and a save never writes (blosc's 0): the compressor's default
        return Compression(compressor=compressor)


def _same_store(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    a, b = os.fspath(src), os.fspath(dst)
    directory_a, directory_b = directory_of(a), directory_of(b)
    if directory_a is not None and directory_b is not None:
        return os.path.realpath(directory_a) == os.path.realpath(directory_b)
    return a.rstrip("/") == b.rstrip("/")
