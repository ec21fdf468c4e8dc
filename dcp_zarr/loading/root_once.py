"""The root zarr.json of a ``dcp.load``, read by DCP's coordinator alone and broadcast to the other ranks when the
load runs on several (planning/dcp_internals.py finds the load's ranks), else read by each rank."""

from __future__ import annotations

import pickle

from dcp_zarr.errors import ZarrCheckpointError
from dcp_zarr.format.manifest import Manifest, manifest_of_root
from dcp_zarr.loading.settings import LoadSettings
from dcp_zarr.planning import dcp_internals
from dcp_zarr.store_io.root_document import read_manifest, read_root


def manifest_read_once(settings: LoadSettings) -> Manifest:
    """The coordinator decides for every rank whether it shares the root (``settings.shares_reads()``), and every
    rank of the load joins the broadcast either way: ranks that decided apart (one sees the path on a machine's own
    file system, another on NFS) would otherwise wait in different collectives. On a machine's own file system that
    broadcast carries a few bytes and every rank reads the root itself."""
    load = dcp_internals.dcp_load_wrapper()
    if load is None or not load.use_dist or load.get_world_size() < 2:
        return read_manifest(settings.open())
    payload: tuple | None = None
    if load.is_coordinator:
        try:
            if settings.shares_reads():
                storage = settings.open()
                payload = ("root", read_root(storage), storage.url)
            else:
                payload = ("each",)
        except Exception as exc:  # noqa: BLE001  (every rank raises it, below)
            payload = ("error", _sendable(exc))
    payload = load.broadcast_object(payload)
    assert payload is not None
    if payload[0] == "error":
        raise payload[1]
    if payload[0] == "each":
        return read_manifest(settings.open())
    return manifest_of_root(payload[1], payload[2])


def _sendable(exc: Exception) -> Exception:
    """``exc``, or an error of the same text where it cannot be pickled to the other ranks."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return ZarrCheckpointError(f"{type(exc).__name__}: {exc}")
