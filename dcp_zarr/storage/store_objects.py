"""Zarr store objects given instead of a path or URL (``ZarrWriter(store=zarr.storage.ObjectStore(...))``).

A store object is an object store as far as the commit protocol goes: no rename, the ranks write in place and the
root ``zarr.json``, written last, is the commit. The exception is zarr's ``LocalStore``, which is only a directory:
it becomes its root path, so it gets the local fast path (writev, shards written at offsets, the atomic rename).

Every rank builds its own writer, and so its own store object; DCP pickles plans between ranks, so plans never hold
a store, only the same location strings as for a URL, and each rank writes through its own ``self.store``.
"""

from __future__ import annotations

import os

from dcp_zarr.storage.retry import Retrying


def resolve(owner: str, path: str | os.PathLike | None, store, *, writable: bool) -> tuple[str, object | None]:
    """``(path, store)`` for a writer or reader given ``path`` and/or ``store``: at most one of them may be set
    (neither is allowed here: DCP's ``checkpoint_id=`` may still supply the path; ``open_checkpoint`` checks)."""
    path = os.fspath(path) if path is not None else ""
    if store is None:
        return path, None
    if path:
        raise ValueError(f"{owner}: pass either path ({path!r}) or store= ({store!r}), not both")
    from zarr.abc.store import Store
    from zarr.storage import LocalStore

    if not isinstance(store, Store):
        raise TypeError(f"{owner}: store= must be a zarr store (zarr.storage.ObjectStore, FsspecStore, MemoryStore, "
                        f"LocalStore, ...), got {type(store).__name__}")
    if writable and store.read_only:
        raise ValueError(f"{owner}: store= {store!r} is read-only; a writer needs a writable store")
    if isinstance(store, LocalStore):
        return os.fspath(store.root), None
    return "", store


def label(store) -> str:
    """How errors and ``StorageMeta`` name a store object: its URL where zarr can tell one."""
    from zarr.storage import FsspecStore

    if isinstance(store, FsspecStore):
        protocol = store.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        return f"{protocol}://{store.path.lstrip('/')}"
    return str(store)


def open_store(store, retrying: Retrying):
    """The Storage of a store object, every call through ``retrying`` (the writer's or reader's)."""
    from dcp_zarr.storage.zarr_store import ZarrStoreStorage

    return ZarrStoreStorage(store, label(store), retrying)
