"""Conversions: a DCP directory or a zarr store -> a zarr store (compressed or not); a checkpoint (either format) ->
a ``torch.save`` file or safetensors.

Nothing existing is replaced without ``overwrite=True``, and a replaced output is swapped in only once the new one
is completely written. Local outputs only for ``torch`` and ``safetensors``; the zarr output may be any URL.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Sequence

import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr.errors import CheckpointExistsError, ConversionError, IncompleteCheckpointError, NotACheckpointError
from dcp_zarr.format.compression import COMPRESSORS, Compression
from dcp_zarr.format.manifest import TENSOR, TensorEntry
from dcp_zarr.offline import Checkpoint, Entry, open_checkpoint, refuse_a_file
from dcp_zarr.progress import progress_bar
from dcp_zarr.storage import is_local, local_path
from dcp_zarr.store_io import commit
from dcp_zarr.tools.dcp_dir import DcpCheckpoint, is_dcp_directory, open_any_checkpoint
from dcp_zarr.writer import ZarrWriter

FORMATS = ("zarr", "torch", "safetensors")
# Hugging Face's default max_shard_size for save_pretrained.
DEFAULT_SAFETENSORS_SHARD_BYTES = 5 * 1000**3
SAFETENSORS_INDEX = "model.safetensors.index.json"
# ``compression`` of a conversion to zarr: the source's (a zarr store's compressor and level; none for a DCP
# directory). "none" (or None, False) stores every array as it is; a compressor's name, True or a Compression
# compresses as ``ZarrWriter(compression=...)`` does.
KEEP = "keep"
COMPRESSION_CHOICES = (KEEP, "none", *COMPRESSORS)


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, overwrite: bool = False,
            storage_options: dict | None = None, progress: bool | None = False, **options) -> list[str]:
    """Convert ``src`` (a zarr store or DCP directory) into format ``to``; returns the paths written.

    ``to="zarr"`` takes ``compression`` (``KEEP`` by default: the source's) and ``thread_count``."""
    if to not in FORMATS:
        raise ConversionError(f"unknown target format {to!r}; expected one of {', '.join(FORMATS)}")
    if to == "zarr":
        if is_local(src):
            refuse_a_file(local_path(src))
        if is_dcp_directory(src):
            dcp_to_zarr(src, dst, overwrite=overwrite, storage_options=storage_options, **options)
        else:
            zarr_to_zarr(src, dst, overwrite=overwrite, storage_options=storage_options, **options)
        return [os.fspath(dst)]
    if "compression" in options:
        raise ConversionError(f"compression applies to a conversion to zarr, not to {to}")
    _check_local_output(dst, overwrite)
    source = open_any_checkpoint(src, storage_options)
    if to == "torch":
        return [to_torch_save(source, dst, overwrite=overwrite, progress=progress)]
    return to_safetensors(source, dst, overwrite=overwrite, progress=progress, **options)


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
        if not is_local(os.fspath(src)):
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
            key = (stored.codec.cname, stored.codec.clevel)
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    compressor, level = max(counts, key=lambda k: counts[k])
    try:
        return Compression(compressor=compressor, level=level)
    except ValueError:  # a level zarr's blosc codec takes and a save never writes (0): the compressor's default
        return Compression(compressor=compressor)


def _same_store(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    a, b = os.fspath(src), os.fspath(dst)
    if is_local(a) and is_local(b):
        return os.path.realpath(local_path(a)) == os.path.realpath(local_path(b))
    return a.rstrip("/") == b.rstrip("/")


def to_torch_save(source: Checkpoint | DcpCheckpoint, dst: str | os.PathLike, *, overwrite: bool = False,
                  progress: bool | None = False) -> str:
    """The full, unsharded state dict as one ``torch.save`` file (``torch.load(dst, weights_only=True)`` reads it)."""
    target = _check_local_output(dst, overwrite)
    state = source.load_full_state_dict(progress=progress)
    staging = _staging_name(target)
    try:
        torch.save(state, staging)
        _swap_into_place(staging, target)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return target


def to_safetensors(source: Checkpoint | DcpCheckpoint, dst: str | os.PathLike, *, overwrite: bool = False,
                   prefix: Sequence | None = None, max_shard_bytes: int = DEFAULT_SAFETENSORS_SHARD_BYTES,
                   progress: bool | None = False) -> list[str]:
    """Model weights as safetensors, named by their FQN under ``prefix`` (default: ``("model",)`` when the
    checkpoint has a ``model`` group, else everything).

    ``dst`` ending in ``.safetensors`` is one file. Otherwise it is a directory in Hugging Face's layout: one
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` each (a
    larger tensor gets a shard of its own) plus ``model.safetensors.index.json``. Non-tensor entries are skipped.
    """
    from safetensors.torch import save_file

    target = _check_local_output(dst, overwrite)
    tensors = _weights(source, prefix)
    if not tensors:
        raise ConversionError(f"{source.url}: no tensors under {tuple(prefix) if prefix else 'the root'} to convert")
    single_file = target.endswith(".safetensors")
    shards = [tensors] if single_file else _shard(tensors, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    staging = _staging_name(target)
    try:
        if not single_file:
            os.makedirs(staging)
        with progress_bar(sum(e.nbytes for _, e in tensors), "converting", enabled=progress) as bar:
            for shard, name in zip(shards, names):
                path = staging if single_file else os.path.join(staging, name)
                data = {}
                for key, entry in shard:
                    data[key] = source.read_tensor(entry).contiguous()
                    bar.update(entry.nbytes)
                save_file(data, path, metadata={"format": "pt"})
                del data
        if not single_file and len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for _, e in tensors)},
                     "weight_map": {key: name for shard, name in zip(shards, names) for key, _ in shard}}
            with open(os.path.join(staging, SAFETENSORS_INDEX), "w") as f:
                json.dump(index, f, indent=2)
        _swap_into_place(staging, target)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)
        elif os.path.exists(staging):
            os.remove(staging)
    if single_file:
        return [target]
    return sorted(os.path.join(target, name) for name in os.listdir(target))


def _weights(source: Checkpoint | DcpCheckpoint, prefix: Sequence | None) -> list[tuple[str, Entry]]:
    """(name, entry) of every tensor under ``prefix``; the name is the state-dict path below it, dot-joined."""
    if prefix is None:
        prefix = ("model",) if any(e.path[:1] == ("model",) and e.kind == TENSOR for e in source) else ()
    prefix = tuple(prefix)
    chosen: list[tuple[str, Entry]] = []
    for entry in source:
        if entry.kind == TENSOR and tuple(entry.path[: len(prefix)]) == prefix and len(entry.path) > len(prefix):
            chosen.append((".".join(map(str, entry.path[len(prefix):])), entry))
    return chosen


def _shard(tensors: list, max_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for key, entry in tensors:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, entry))
        size += entry.nbytes
    return shards


def _check_local_output(dst: str | os.PathLike, overwrite: bool) -> str:
    """The absolute local path of an output, refusing URLs and anything we must not replace."""
    location = os.fspath(dst)
    if not is_local(location):
        raise ConversionError(f"{location}: torch and safetensors outputs must be local paths")
    target = local_path(location)
    if not os.path.lexists(target):
        if not os.path.isdir(os.path.dirname(target)):
            raise ConversionError(f"{target}: the parent directory does not exist")
        return target
    if not overwrite:
        raise CheckpointExistsError(
            f"Checkpoint already exists: {target}; a conversion replaces an output only when asked: pass "
            "--overwrite (overwrite=True) to replace it, or choose another output path")
    if os.path.isdir(target):
        # Only a directory holding nothing but a previous safetensors export is ours to replace.
        foreign = [n for n in os.listdir(target) if not (n.endswith(".safetensors") or n == SAFETENSORS_INDEX)]
        if foreign:
            raise CheckpointExistsError(
                f"{target} is a directory holding other files ({', '.join(sorted(foreign)[:3])}), not a previous "
                "safetensors export; refusing to replace it, with --overwrite too. Choose another output path, or "
                "move those files away")
    return target


def _staging_name(target: str) -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:8]}")


def _swap_into_place(staging: str, target: str) -> None:
    """Move the finished output to ``target``; an old one there is moved aside first and removed last."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    aside = _staging_name(target) + ".replaced"
    os.rename(target, aside)
    os.rename(staging, target)
    if os.path.isdir(aside) and not os.path.islink(aside):
        shutil.rmtree(aside)
    else:
        os.remove(aside)
