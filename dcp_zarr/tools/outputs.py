"""Local output files of a conversion (``torch.save`` and safetensors): refused where they would replace what is not
ours, written under a staging name and swapped into place once complete. Torch-free."""

from __future__ import annotations

import os
import shutil
import uuid

from dcp_zarr.errors import CheckpointExistsError, ConversionError
from dcp_zarr.storage import directory_of

SAFETENSORS_INDEX = "model.safetensors.index.json"


def check_local_output(dst: str | os.PathLike, overwrite: bool) -> str:
    """The absolute local path of an output, refusing URLs and anything we must not replace."""
    location = os.fspath(dst)
    target = directory_of(location)
    if target is None:
        raise ConversionError(f"{location}: torch and safetensors outputs must be local paths")
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


def staging_name(target: str) -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:8]}")


def swap_into_place(staging: str, target: str) -> None:
    """Move the finished output to ``target``; an old one there is moved aside first and removed last."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    aside = staging_name(target) + ".replaced"
    os.rename(target, aside)
    os.rename(staging, target)
    if os.path.isdir(aside) and not os.path.islink(aside):
        shutil.rmtree(aside)
    else:
        os.remove(aside)
