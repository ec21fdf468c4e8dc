"""What every adapter of ``dcp_zarr.integrations`` does first: import its framework, or say how to install it, and
check that the framework still has the internals the adapter relies on, naming both versions when it does not."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable
from types import ModuleType

from dcp_zarr.errors import FrameworkNotInstalledError, FrameworkVersionError


def import_framework(module: str, distribution: str, written_for: str, adapter: str) -> ModuleType:
    """``importlib.import_module(module)``, or ``FrameworkNotInstalledError`` naming what to ``pip install``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FrameworkNotInstalledError(
            f"{adapter} adapts {distribution}, which cannot be imported here ({exc}); install it with dcp_zarr's "
            f"extra, pip install 'dcp-zarr[{distribution}]', or alone, pip install '{distribution}=={written_for}' "
            f"(the version {adapter} was written against and is tested with)") from exc


def installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def require_internals(distribution: str, written_for: str, adapter: str, missing: Iterable[str]) -> None:
    """Raise ``FrameworkVersionError`` if any internal the adapter relies on is ``missing`` (described, one each)."""
    missing = list(missing)
    if missing:
        raise FrameworkVersionError(
            f"{adapter} was written against {distribution} {written_for} and relies on internals that "
            f"{distribution} {installed_version(distribution)} does not have: {'; '.join(missing)}. "
            f"Install {distribution}=={written_for}, or a dcp_zarr release that supports "
            f"{distribution} {installed_version(distribution)}")


def missing_attributes(owner: object, names: Iterable[str], where: str) -> list[str]:
    """``where.name`` for each of ``names`` that ``owner`` lacks."""
    return [f"{where}.{name}" for name in names if not hasattr(owner, name)]
