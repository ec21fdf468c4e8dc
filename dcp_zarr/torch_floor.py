"""The torch that dcp_zarr's DCP parts need, checked when the first of them is imported.

torch is not one of dcp-zarr's install requirements (pyproject.toml): installing dcp-zarr must never replace the torch
build a GPU node has, and reading a checkpoint needs no torch at all (zarr-python, ``dcp-zarr inspect``, ``verify``,
``diff``). So every module of dcp_zarr that imports torch imports this one first (ruff's isort keeps it first: the
``torch-floor`` section in pyproject.toml; ``tests/project/test_torch_floor.py`` imports each module where torch is
missing and where it is too old), and the writer, the reader, the planners, ``CheckpointManager`` and the framework
adapters fail to import with one ``TorchRequiredError`` that names what is missing and the command that fixes it.

Implementation.
"""

from __future__ import annotations

import re

from dcp_zarr.errors import TorchRequiredError

# The oldest torch release dcp_zarr's DCP parts run on (docs/compatibility.md says why); pyproject.toml's test extra
# asks for the same, and CI's floor pass installs it.
TORCH_FLOOR = (2, 11)
TORCH_REQUIREMENT = f"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"
_WHAT = ("dcp_zarr's torch.distributed.checkpoint parts (ZarrWriter, ZarrReader, the planners, CheckpointManager, "
         "the framework adapters)")
_LOOKING = "reading checkpoints needs no torch: zarr-python, dcp-zarr inspect, verify and diff"


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.14.1+cu130" -> (2, 14); "2.16.0.dev20261201" -> (2, 16)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"torch version {version!r} does not start with MAJOR.MINOR")
    return int(found[1]), int(found[2])


def check_torch() -> None:
    """Raise TorchRequiredError unless a torch of at least TORCH_FLOOR imports."""
    try:
        import torch
    except ImportError as exc:
        raise TorchRequiredError(
            f"{_WHAT} need {TORCH_REQUIREMENT}, which cannot be imported here ({exc}). Install torch first: "
            f"pip install '{TORCH_REQUIREMENT}' (or your platform's build from pytorch.org); {_LOOKING}") from None
    if release(torch.__version__) < TORCH_FLOOR:
        raise TorchRequiredError(
            f"{_WHAT} need {TORCH_REQUIREMENT}; this is torch {torch.__version__}. Upgrade it: pip install -U "
            f"'{TORCH_REQUIREMENT}' (or your platform's build from pytorch.org); {_LOOKING}")


check_torch()
