"""What every adapter of ``dcp_zarr.integrations`` does first: import its framework, or say how to install it, and
check that the framework still has the internals the adapter relies on, naming both versions when it does not; and
what each does before a load: refuse a path that holds no committed store in words that name the framework's way on
(``refuse_unless_committed``), rather than DCP's wrapper around the reader's error; and how each takes a compression
choice to pass to ``ZarrWriter`` (``compression_choice``), and an incremental one (``incremental_choice``), and say
so in their signatures (``signature_with_compression``)."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
from collections.abc import Iterable
from types import ModuleType

from dcp_zarr.errors import (
    FrameworkNotInstalledError,
    FrameworkVersionError,
    IncompleteCheckpointError,
    NotACheckpointError,
)
from dcp_zarr.format.compression import COMPRESSORS, Compression
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.storage import open_storage
from dcp_zarr.store_io.commit import stopped_save

_LISTED = 3  # names of foreign files an error shows


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


def refuse_unless_committed(path: str | os.PathLike, who: str, instead: str) -> None:
    """Return if the local ``path`` holds a committed dcp_zarr store; else raise ``IncompleteCheckpointError`` (an
    interrupted save) or ``NotACheckpointError`` (missing, empty, a file, anything else) saying, after ``who`` (the
    adapter's method), what is there, that nothing was loaded, and ``instead``: the framework's next step."""
    location = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(location)
    if not os.path.exists(location):
        what = "does not exist"
    elif not os.path.isdir(location):
        what = "is a file, not a checkpoint directory"
    elif CheckpointRoot(parent).is_complete(name):
        return
    elif not os.listdir(location):
        what = "is an empty directory"
    else:
        why = stopped_save(open_storage(location, read_only=True))
        if why:
            raise IncompleteCheckpointError(
                f"{who}: {location} holds an interrupted dcp_zarr save, not a checkpoint ({why}): its save stopped "
                f"before the commit, so nothing loads it. Nothing was loaded. {instead}")
        files = sorted(os.listdir(location))
        what = (f"holds no dcp_zarr checkpoint (no committed root zarr.json; it holds "
                f"{', '.join(files[:_LISTED])}{', ...' if len(files) > _LISTED else ''})")
    raise NotACheckpointError(f"{who}: {location} {what}. Nothing was loaded. {instead}")


# What an adapter's ``compression`` argument takes: ZarrWriter's own choices.
COMPRESSION_CHOICES = (f"pass one of the compressors ({', '.join(map(repr, COMPRESSORS))}), True (lz4), a "
                       "dcp_zarr.Compression, or None (the default: nothing compressed)")


def compression_choice(value: object, who: str, name: str = "compression",
                       accepted: str = COMPRESSION_CHOICES) -> Compression | None:
    """``Compression.of(value)``, what the adapter passes to ``ZarrWriter(compression=...)``, checked when the
    adapter is built rather than at its first save: a bad value raises ``ValueError`` (a string that names no
    compressor) or ``TypeError`` (anything else) naming ``who`` (the adapter), ``name`` (its argument or config
    field, as the user writes it), the value and what is ``accepted``."""
    try:
        return Compression.of(value)
    except ValueError as exc:
        raise ValueError(f"{who}: {name}={value!r} names no compressor: {accepted}") from exc
    except TypeError as exc:
        raise TypeError(f"{who}: {name}={value!r} is not a compression choice: {accepted}") from exc


def incremental_choice(value: object, who: str, name: str = "incremental") -> bool:
    """``value`` as what the adapter passes to ``ZarrWriter(incremental=...)``, checked when the adapter is built:
    True or False (1 and 0 too, as ``CheckpointManager(incremental=)`` takes them), else ``TypeError`` naming ``who``,
    ``name`` and the value."""
    if value not in (True, False):
        raise TypeError(f"{who}: {name}={value!r} is not a choice: pass True (each checkpoint saved incrementally, "
                        "reusing the unchanged chunks of the one saved before) or False (the default: full saves)")
    return bool(value)


def signature_with_compression(cls: type, framework_class: type, *, incremental: bool = False,
                               **defaults: object) -> None:
    """Give ``cls``, whose ``__init__`` passes ``*args, **kwargs`` on to ``framework_class``, the framework's
    signature with its ``defaults`` changed and ``compression`` (and, with ``incremental``, ``incremental``) added as
    keyword-only arguments, for ``help()``, ``inspect.signature`` and docs/api.md (rather than ``(*args,
    compression=None, **kwargs)``)."""
    signature = inspect.signature(framework_class)
    parameters = [p.replace(default=defaults[p.name]) if p.name in defaults else p
                  for p in signature.parameters.values()]
    last = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    added = [inspect.Parameter("compression", inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation="str | bool | Compression | None")]
    if incremental:
        added.append(inspect.Parameter("incremental", inspect.Parameter.KEYWORD_ONLY, default=False,
                                       annotation="bool"))
    parameters[last:last] = added
    cls.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
