"""Versions recorded in every checkpoint.
Implementation: ``dcp_zarr.__version__`` is the public name."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dcp-zarr")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"


def versions() -> dict:
    import torch
    import zarr

    return {"dcp_zarr": __version__, "torch": torch.__version__, "zarr": zarr.__version__}
