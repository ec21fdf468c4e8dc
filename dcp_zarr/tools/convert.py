"""Conversions: a DCP directory or a zarr store -> a zarr store (compressed or not, ``resave.py``); a checkpoint
(either format) -> a ``torch.save`` file or safetensors (``safetensors_export.py``).

Nothing existing is replaced without ``overwrite=True``, and a replaced output is swapped in only once the new one
is completely written. Local outputs only for ``torch`` and ``safetensors``; the zarr output may be any URL. A zarr
store converts to safetensors without torch; the rest needs it, and imports it only when asked for.
"""

from __future__ import annotations

import os

from dcp_zarr.errors import ConversionError, TorchNotImportableError
from dcp_zarr.offline import Checkpoint, is_dcp_directory, open_checkpoint, refuse_a_file
from dcp_zarr.storage import directory_of
from dcp_zarr.tools.outputs import check_local_output, staging_name, swap_into_place
from dcp_zarr.tools.safetensors_export import DEFAULT_SAFETENSORS_SHARD_BYTES, to_safetensors

FORMATS = ("zarr", "torch", "safetensors")
__all__ = ["DEFAULT_SAFETENSORS_SHARD_BYTES", "FORMATS", "convert", "to_torch_save"]


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, overwrite: bool = False,
            storage_options: dict | None = None, progress: bool | None = False, **options) -> list[str]:
    """Convert ``src`` (a zarr store or DCP directory) into format ``to``; returns the paths written.

    ``to="zarr"`` takes ``compression`` (``KEEP`` by default: the source's) and ``thread_count``."""
    if to not in FORMATS:
        raise ConversionError(f"unknown target format {to!r}; expected one of {', '.join(FORMATS)}")
    if to == "zarr":
        from dcp_zarr.tools.resave import dcp_to_zarr, zarr_to_zarr

        directory = directory_of(src)
        if directory is not None:
            refuse_a_file(directory)
        if is_dcp_directory(src):
            dcp_to_zarr(src, dst, overwrite=overwrite, storage_options=storage_options, **options)
        else:
            zarr_to_zarr(src, dst, overwrite=overwrite, storage_options=storage_options, **options)
        return [os.fspath(dst)]
    if "compression" in options:
        raise ConversionError(f"compression applies to a conversion to zarr, not to {to}")
    check_local_output(dst, overwrite)
    source = open_source(src, storage_options)
    if to == "torch":
        return [to_torch_save(source, dst, overwrite=overwrite, progress=progress)]
    return to_safetensors(source, dst, overwrite=overwrite, progress=progress, **options)


def open_source(path: str | os.PathLike, storage_options: dict | None):
    """A dcp_zarr store (any URL, torch-free) or a DCP directory (local; only torch reads it), whichever ``path`` is;
    ``TorchNotImportableError`` naming it for a DCP directory where torch cannot be imported."""
    if not is_dcp_directory(path):
        return open_checkpoint(path, storage_options)
    try:
        from dcp_zarr.tools.dcp_dir import DcpCheckpoint
    except ImportError as exc:
        if torch_importable():
            raise
        raise TorchNotImportableError(
            f"{os.fspath(path)} is a torch.distributed.checkpoint directory (.metadata + .distcp files); reading it "
            f"needs torch, which cannot be imported here ({exc})") from None
    return DcpCheckpoint(path)


def torch_importable() -> bool:
    # Asked only after an ImportError: trying the import itself is the one reliable test (torch may be installed
    # but broken), and where torch imports, it is needed next anyway.
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def to_torch_save(source: Checkpoint, dst: str | os.PathLike, *, overwrite: bool = False,
                  progress: bool | None = False) -> str:
    """The full, unsharded state dict as one ``torch.save`` file (``torch.load(dst, weights_only=True)`` reads it)."""
    import torch

    target = check_local_output(dst, overwrite)
    state = source.load_full_state_dict(progress=progress)
    staging = staging_name(target)
    try:
        torch.save(state, staging)
        swap_into_place(staging, target)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return target
