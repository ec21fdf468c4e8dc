"""What a ``ZarrReader`` was made with: made once per reader, checked as it is made, fixed for each load."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from dcp_zarr.collective.transfer import DEFAULT_EXCHANGE_BYTES
from dcp_zarr.store_io.target import StoreTarget, check_bytes


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class LoadSettings(StoreTarget):
    safe_globals: list = dataclasses.field(default_factory=list)  # extra types torch.load may build from values
    process_group: Any = None  # the group dcp.load runs on, over which reads are shared
    read_once: bool | None = None
    read_once_below: int | None = None
    exchange_bytes: int = DEFAULT_EXCHANGE_BYTES

    owner: ClassVar[str] = "ZarrReader"
    dcp_call: ClassVar[str] = "dcp.load"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bytes("read_once_below", self.read_once_below, 0, none_for_default=True)
        check_bytes("exchange_bytes", self.exchange_bytes, 1)
        if self.read_once is not None and type(self.read_once) is not bool:  # "false" is truthy: never guess
            raise ValueError(f"read_once={self.read_once!r}: expected True, False or None for the storage's default")

    def _open_options(self) -> dict:
        return {"read_only": True}

    def shares_reads(self) -> bool:
        """``read_once``, or by default whether the storage's default aggregates. Ranks may decide apart (each sees
        its own mount): the coordinator's decides the root's broadcast, and reads are shared only where every
        rank's does (ZarrReader.prepare_global_plan)."""
        if self.read_once is not None:
            return self.read_once
        return self.storage_aggregate_below() > 0  # object stores, shared FS
