"""Reading one manifest entry's stored data, checked: shared by ``ZarrReader`` and the offline API.

Tensor entries get a ``RegionReader`` only after their array's ``zarr.json`` agrees with the manifest; value
entries decode their tagged JSON; object entries (``torch.save`` bytes) load with ``weights_only=True`` only.
Only that last step imports torch: everything else here serves ``inspect``, ``verify`` and ``diff`` without it.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import io
import pathlib
import uuid
from collections.abc import Sequence

from dcp_zarr.errors import CorruptChunkError, MalformedMetadataError, TorchNotImportableError, UntrustedTypeError
from dcp_zarr.format.array_checks import checked_layout
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.dtype_table import STORED_DTYPES
from dcp_zarr.format.encoding import CHECKSUM_BYTES, verify_plain
from dcp_zarr.format.manifest import Entry, ObjectEntry, TensorEntry, ValueEntry
from dcp_zarr.format.values import decode_value
from dcp_zarr.storage import Storage
from dcp_zarr.store_io.chunks import RegionReader

# An array's zarr.json is a few hundred bytes; one larger than this is refused before it is parsed.
MAX_ARRAY_METADATA_BYTES = 1 << 20


def tensor_reader(storage: Storage, entry: Entry, fqn: str, array_doc: dict | None = None,
                  checked: ChunkLayout | str | None = None) -> RegionReader:
    """A RegionReader for a tensor entry, once its array's zarr.json is checked against the manifest
    (format/array_checks.py): ``checked``, the check of its copy in the root (node_copies.py) as the manifest
    was read (``Manifest.checked_copies``: the layout, or why the copy is refused), or ``array_doc`` given, else the
    array's own, read here."""
    if not isinstance(entry, TensorEntry):
        raise MalformedMetadataError(f"{storage.url}: entry {fqn!r} is stored as a {entry.kind}, not a tensor")
    node = entry.node
    if isinstance(checked, str):
        raise MalformedMetadataError(checked)
    if checked is None:
        if array_doc is None:
            array_doc = array_document(storage, node, fqn)
        checked = checked_layout(array_doc, f"{storage.url}: array {node!r}", fqn, entry.shape, entry.chunk_shape,
                                 entry.inner_chunk_rows, entry.dtype, entry.codec, entry.fill)
    return RegionReader(storage, node, checked, STORED_DTYPES[entry.dtype][0], entry.fill)


def array_document(storage: Storage, node: str, fqn: str) -> dict:
    """The array's own zarr.json (size-limited: it is a few hundred bytes)."""
    try:
        return storage.read_json(f"{node}/zarr.json", max_bytes=MAX_ARRAY_METADATA_BYTES)
    except FileNotFoundError:
        raise CorruptChunkError(f"{storage.url}: array {node!r} of entry {fqn!r} has no zarr.json") from None
    except MalformedMetadataError:
        raise
    except (ValueError, RecursionError) as exc:
        raise MalformedMetadataError(f"{storage.url}: array {node!r}: zarr.json is not valid JSON ({exc})") from None


def stored_value(storage: Storage, entry: Entry, fqn: str, safe_globals: list, how_to_allow: str):
    """The Python value of a non-tensor entry; ``how_to_allow`` tells the user where to pass ``safe_globals``."""
    if isinstance(entry, TensorEntry):
        raise MalformedMetadataError(f"{storage.url}: entry {fqn!r} is a tensor, but a non-tensor value was requested")
    if isinstance(entry, ValueEntry):
        return decode_value(entry.value)  # checked when the manifest was read
    payload = stored_object_bytes(storage, entry, fqn)
    try:
        import torch  # here, not above: only decoding torch.save bytes needs it
    except ImportError as exc:
        raise TorchNotImportableError(
            f"{storage.url}: entry {fqn!r} is stored as torch.save bytes; decoding them needs torch, which cannot be "
            f"imported here ({exc})") from None
    try:
        with torch.serialization.safe_globals([*STANDARD_SAFE_GLOBALS, *safe_globals]):
            return torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as exc:
        untrusted = untrusted_types(payload, safe_globals)
        if untrusted or isinstance(exc, (ImportError, AttributeError)):
            types = ", ".join(untrusted) or _unpickling_reason(exc)
            raise UntrustedTypeError(
                f"{storage.url}: entry {fqn!r} is stored as torch.save bytes holding types that "
                f"torch.load(weights_only=True) does not trust or cannot import here ({types}). If you trust them, "
                f"pass them as {how_to_allow}") from None
        raise MalformedMetadataError(
            f"{storage.url}: entry {fqn!r} is stored as torch.save bytes that do not load with "
            f"torch.load(weights_only=True) ({_unpickling_reason(exc)})") from None


def _qualified_name(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


# Value types that DCP's own reader (torch.load(weights_only=False)) brings back and whose unpickling only builds a
# value of bounded cost: trusted by default, so that such state loads without extra options. (Not Fraction: it
# unpickles from a string, and Fraction("1e20000000") computes 10**20000000.) Anything else (your own classes,
# enums, dataclasses) needs ``safe_globals``. Small numpy values and BytesIO are JSON (values.py); larger ones land
# here, hence numpy's array globals (they rebuild an ndarray of a dtype; object arrays unpickle their items through
# this same allow-list).
def _standard_safe_globals() -> list:
    import numpy as np

    paths = [pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath]
    return [
        datetime.date, datetime.time, datetime.datetime, datetime.timedelta, datetime.timezone, decimal.Decimal,
        uuid.UUID, slice, range, collections.Counter,  # (torch's weights_only unpickler fills no defaultdict, deque)
        io.BytesIO, *paths,
        # Python 3.13 moved the pathlib classes to pathlib._local; pickles written by 3.11/3.12 name them "pathlib.X"
        *[(cls, f"pathlib.{cls.__name__}") for cls in paths if cls.__module__ != "pathlib"],
        np.ndarray, np.dtype, _numpy_reconstruct(np),
        *{type(np.dtype(code)) for code in "?bhilqBHILQefdgFDG"},
    ]


def _numpy_reconstruct(np):
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    return core.multiarray._reconstruct


STANDARD_SAFE_GLOBALS = _standard_safe_globals()


def _trusted_name(entry) -> str:
    return entry[1] if isinstance(entry, tuple) else _qualified_name(entry)


_STANDARD_NAMES = {_trusted_name(t) for t in STANDARD_SAFE_GLOBALS}


def untrusted_types(payload: bytes, safe_globals: Sequence = ()) -> list[str]:
    """The globals of ``torch.save`` bytes that neither the standard list nor ``safe_globals`` trusts."""
    import torch

    trusted = _STANDARD_NAMES | {_trusted_name(t) for t in safe_globals
                                 if isinstance(t, tuple) or hasattr(t, "__qualname__")}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(payload))
    except Exception:  # not a torch.save archive at all: the caller reports it as malformed
        return []
    return sorted(name for name in found if name not in trusted)


def stored_object_bytes(storage: Storage, entry: ObjectEntry, fqn: str) -> bytes:
    """The ``torch.save`` bytes of an object entry, their size checked against the manifest and their crc32c
    verified; nothing is unpickled (so no torch)."""
    where = f"array {entry.node!r} chunk {entry.chunk}"
    stored_bytes = entry.nbytes + CHECKSUM_BYTES
    try:
        raw = storage.read_range(f"{entry.node}/{entry.chunk}", 0, stored_bytes + 1)  # bounded by the manifest
    except FileNotFoundError:
        raise CorruptChunkError(f"{storage.url}: {where} of entry {fqn!r} is missing from the store") from None
    if len(raw) != stored_bytes:
        size = f"more than {stored_bytes}" if len(raw) > stored_bytes else str(len(raw))
        raise CorruptChunkError(f"{storage.url}: {where} of entry {fqn!r} holds {size} bytes; the manifest says "
                                f"{stored_bytes}")
    return bytes(verify_plain(raw, where))


def _unpickling_reason(exc: Exception) -> str:
    """The line of torch.load's long weights_only message that names the refused type."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "GLOBAL" in line]
    return (named or lines or [repr(exc)])[0]
