"""``StoreTarget``: where a writer saves or a reader loads, and what its storage's capabilities decide for it.

The base of ``saving/settings.SaveSettings`` and ``loading/settings.LoadSettings``: a path or URL (with fsspec's
options) or a zarr store object, and the ``Retrying`` every storage they open shares. What depends on the kind of
storage is asked of its class (``storage_class``), never of the path's form.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from dcp_zarr.storage import Storage, default_aggregate_below, open_storage, storage_class, store_objects
from dcp_zarr.storage.retry import Retrying


def check_bytes(name: str, value: Any, minimum: int, *, none_for_default: bool = False) -> None:
    """Refuse a byte count an option was given that is not an int of at least ``minimum`` (None where the option
    means the storage's default by it), naming the option."""
    if value is None and none_for_default:
        return
    if type(value) is not int or value < minimum:
        default = ", or None for the storage's default" if none_for_default else ""
        raise ValueError(f"{name}={value!r}: expected a number of bytes >= {minimum}{default}")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StoreTarget:
    path: str
    store: Any = None  # a zarr store object instead of a path (store=)
    storage_options: dict | None = None
    thread_count: int = 4  # concurrent chunk transfers per rank
    retrying: Retrying = dataclasses.field(default_factory=Retrying)  # shared by every storage opened (retry.py)

    owner: ClassVar[str] = "ZarrWriter"  # for messages: the class made with these settings
    dcp_call: ClassVar[str] = "dcp.save"

    def __post_init__(self) -> None:
        object.__setattr__(self, "thread_count", max(1, int(self.thread_count)))

    def label(self) -> str:
        """The store's name in messages and DCP's ``StorageMeta``: its path or URL, or its store object's label."""
        return store_objects.label(self.store) if self.store is not None else self.path

    def open(self, location: str | None = None) -> Storage:
        """The storage at ``location`` (default: the target's own path); a store object is always itself."""
        location = self.path if location is None else location
        if self.store is None and not location:
            raise ValueError(f"{self.owner} needs a path or a store: pass path or store=, or checkpoint_id= to "
                             f"{self.dcp_call}")
        if self.store is not None:
            return open_storage(store=self.store, retry=self.retrying)
        return open_storage(location, self.storage_options, retry=self.retrying, **self._open_options())

    def _open_options(self) -> dict:
        return {}

    def pauses_collector(self) -> bool:
        """Whether transfers run with the garbage collector paused, as the storage says (gc_pause.py says why)."""
        return self.store is None and storage_class(self.path).transfers_pause_collector

    def storage_aggregate_below(self) -> int:
        """The storage's default piece size under which transfers are aggregated (0: never)."""
        return default_aggregate_below(self.path, self.store, self.retrying)
